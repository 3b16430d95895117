"""What every protocol front end shares: the models, how a request runs, metrics.

The REST app and the gRPC servicer decode a request into numpy arrays, call
:meth:`Engine.infer`, and encode what it returns; they never touch a model
directly. The engine checks the inputs against the spec (so a bad request is
a :class:`~neuropod.errors.SpecError` before it can join a batch), admits it
within the model's :class:`ModelLimits` (a full queue refuses it at once with
:class:`~neuropod_serving.server.registry.ModelBusyError`), runs the model in a
thread of the model's own (or on the calling thread when the model has proved
fast, see :meth:`Engine.infer`), through the model's
:class:`~neuropod_serving.server.batching.Batcher` when batching is on and the
spec allows it, and records metrics.

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
import collections
import concurrent.futures
import functools
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod.errors import NeuropodError, PackageError, SpecError
from neuropod.spec import SpecValidator
from neuropod_serving.defaults import DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_QUEUED
from neuropod_serving.errors import ModelBusyError, RequestTimeoutError, UnknownModelError
from neuropod_serving.protocol.options import RequestOptions
from neuropod_serving.server.batching import Batcher, BatchPolicy, batch_symbol, writable
from neuropod_serving.server.classification import Classifier
from neuropod_serving.server.metrics import NoMetrics, Recorder
from neuropod_serving.server.registry import (
    MODEL_VERSION,
    Catalog,
    ModelRegistry,
    ModelSettings,
    ServedModel,
)
from neuropod_serving.server.versions import Found

if TYPE_CHECKING:
    from neuropod_serving.server.processes import GroupMember
    from neuropod_serving.server.shared_memory import SharedMemoryRegistry

log = logging.getLogger("neuropod_serving.server")

#: A model whose recent runs took less than this can run on the event loop's
#: thread. Handing a request to a thread and back costs 50 to 250 µs on a busy
#: core (the result wakes the loop through its self-pipe; measured on the
#: 100-input model of bench_serve.py, 0.26 ms a run: 0.96 -> 0.73 ms a request
#: inline), while holding the loop for under a millisecond delays nothing a
#: network client would notice. Slower models run in threads.
INLINE_BELOW_S = 0.001
#: A run that took this long after its model proved fast (a framework's first
#: runs are slow, and do not count) moves the model off the event loop for
#: good: a model that was once this slow may be again, and while it runs on the
#: loop nothing else (health probes included) is answered. A run counts when
#: at least half of it was CPU time of the thread that ran it, so a fast run
#: that a busy core kept waiting does not count, and full garbage collections
#: that fell into a run are not counted as its time.
SLOW_RUN_S = 0.02
# Weight of the newest run in the moving average of a model's run time.
_EWMA = 0.2


class _FullCollections:
    """Seconds this process has spent in full garbage collections (generation 2), counted by a
    ``gc`` callback. A full collection stops every thread for as long as the heap takes to scan
    (about 10 to 20 ms in a server process): a run it fell into is not the model being slow."""

    seconds = 0.0
    _began = 0.0

    @classmethod
    def callback(cls, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                cls._began = time.perf_counter()
            else:
                cls.seconds += time.perf_counter() - cls._began


gc.callbacks.append(_FullCollections.callback)
#: Platforms whose models are arbitrary code (they may sleep or wait on I/O for any
#: input): never run on the event loop, however fast their runs have been.
_NEVER_INLINE = frozenset({"python"})


#: What :meth:`Engine.infer` raises when the request is at fault, not the model:
#: front ends count these as client failures (4xx, INVALID_ARGUMENT/NOT_FOUND/RESOURCE_EXHAUSTED).
CLIENT_ERRORS = (SpecError, UnknownModelError, ModelBusyError, RequestTimeoutError)


@dataclass(frozen=True)
class ModelLimits:
    """How many requests of each model run at once and how many may wait.

    :param max_concurrent: runs of one model at once (unbatched requests;
        a batched model runs as many batches as it has OPE workers). None:
        :data:`DEFAULT_MAX_CONCURRENT`, or 2 per OPE worker when that is more.
    :param max_queued: requests of one model waiting for a run or a batch;
        one more is refused at once with :class:`ModelBusyError`.
    """

    max_concurrent: int | None = None
    max_queued: int = DEFAULT_MAX_QUEUED

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {self.max_concurrent}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be 0 or more, not {self.max_queued}")


class _Gate:
    """Admission and concurrency of one model's requests: at most ``concurrent`` run
    at once and ``capacity`` (running and waiting) are admitted; the next is refused.

    Lock-free on the hot path: the counters are a deque and a SimpleQueue of run
    slots, whose operations are atomic C calls. Threads admitted at the same instant
    may pass ``capacity`` by their number: the bound is a back-pressure limit, not an
    exact one. ``concurrent`` is exact.
    """

    __slots__ = ("_pending", "_slots", "capacity", "concurrent", "limits", "name")

    def __init__(self, name: str, concurrent: int, capacity: int, limits: str) -> None:
        self.name = name
        #: The options that set these limits, with their values (for the refusal's message).
        self.limits = limits
        self.concurrent = concurrent
        self.capacity = capacity
        self._pending: collections.deque[None] = collections.deque()  # one entry per admitted request
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
        if run_now:
            try:
                self._slots.get_nowait()
            except queue.Empty:
                return False
            return True
        return False

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
        """Wait until no admitted request is left (True), or ``timeout`` seconds (False)."""
        deadline = time.monotonic() + timeout
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


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
class _Runner:
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
    gate: _Gate
    #: Threads of this model's own for requests from an event loop: a busy model never holds another's.
    executor: concurrent.futures.ThreadPoolExecutor
    #: Requests of this model that may be running or waiting at once (admitted).
    most_in_flight: int
    ewma_s: float = 1.0  # until measured: assume slow (a thread)
    #: The largest first input (bytes) of a run that took under INLINE_BELOW_S: a request
    #: whose first input is larger never runs on the loop (a graph's run time grows with
    #: its input). The first input only, so that the check costs the same for 2 inputs or 100.
    inline_bytes: int = 0


class Engine:
    """The serving core: a registry of models and how their requests run.

    :param batching: the policy for models whose spec has a batch dimension;
        None (or max_batch_size 1) turns batching off. With the server's OPE
        workers it makes :attr:`default_settings`; a model loaded with a config
        of its own (:meth:`load`) is served with its :attr:`ServedModel.settings` instead.
    :param metrics: where to record; nothing is recorded when None.
    :param limits: runs at once and queue of each model (default: :class:`ModelLimits`'s).
    :param shared_memory: the regions clients register for tensors in shared memory (Triton's
        shared-memory extensions); None: this server takes no tensors in shared memory.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        batching: BatchPolicy | None = None,
        metrics: Recorder | None = None,
        limits: ModelLimits | None = None,
        shared_memory: SharedMemoryRegistry | None = None,
    ) -> None:
        self.registry = registry
        self.shared_memory = shared_memory
        self.batching = batching if batching is not None and batching.max_batch_size > 1 else None
        self.metrics: Recorder = metrics if metrics is not None else NoMetrics()
        #: OPE workers per model (1 in-process): batches in flight.
        self.workers = max(1, int(registry.load_options.get("workers", 1)))
        self.limits = limits if limits is not None else ModelLimits()
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
        self._runners: dict[tuple[str, str], _Runner] = {}
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

    # -- models ----------------------------------------------------------------

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """:raises UnknownModelError: no such model or version is loaded (None: its latest)."""
        return self.registry.get(name, version)

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
        batched = policy is not None and symbol is not None
        concurrent_runs = max_concurrent
        queued = f"--max-queued-requests {self.limits.max_queued}"
        limits = f"neuropod serve --max-concurrent-runs {concurrent_runs} {queued}"
        if batched:
            assert policy is not None
            # Requests a batcher may hold while running: its batches in flight, full.
            concurrent_runs = workers * policy.max_batch_size
            limits = (
                f"{workers} batch(es) of up to {policy.max_batch_size} at once and {queued}: "
                "neuropod serve --workers, --max-batch-size, --max-queued-requests"
            )
        if settings.overridden:
            limits += f"; this model's load config set {', '.join(settings.overridden)}"
        backend = getattr(model, "backend", None)
        runner = _Runner(
            served=served,
            serving=ModelServing(policy if batched else None, workers),
            validator=SpecValidator(model.name, model.inputs, model.outputs, shared_symbols=_shared_symbols(model)),
            required=frozenset(s.name for s in model.inputs),
            batcher=None,
            unbatched_reason="" if symbol is not None else f"no batch dimension: {reason}",
            # Out-of-process workers wait on a pipe: always a thread, so N workers run N requests.
            inline_ok=_in_process(model) and getattr(backend, "platform", None) not in _NEVER_INLINE,
            output_names=[s.name for s in model.outputs],
            gate=_Gate(served.name, concurrent_runs, concurrent_runs + self.limits.max_queued, limits),
            executor=concurrent.futures.ThreadPoolExecutor(
                max_concurrent, thread_name_prefix=f"neuropod-infer-{served.name}"
            ),
            most_in_flight=max(max_concurrent, concurrent_runs) + self.limits.max_queued,
        )
        if batched:
            assert policy is not None
            name, computed = model.name, self.metrics.computed

            def observe(waited: list[float], seconds: float, rows: int, prepared: float, extracted: float) -> None:
                computed(name, seconds, rows, len(waited), prepared, extracted, waited)

            # Batched runs are timed as unbatched ones are: whether the model may run on the event
            # loop follows its run time however its requests ran.
            runner.batcher = Batcher(
                name, functools.partial(self._timed, runner), policy, inflight=workers, observe=observe,
                rows_promised=_shared_symbols(model),
            )  # fmt: skip
        self._runners[(served.name, served.version)] = runner

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

    def poll(self, drain_s: float = 30.0) -> None:
        """Bring the loaded models in step with the repository as it is now: load the versions
        the policy serves that are new or whose files changed, and unload those removed from it
        (after their requests finish, as :meth:`load`). A version that fails to load is logged
        once, listed with its reason, and tried again only once its files change; it replaces
        nothing. When a repository PATH cannot be listed, nothing is unloaded this time."""
        retired: list[tuple[ServedModel, _Runner | None]] = []
        # Listed (and new packages downloaded) before the lock: a slow store holds up no load or unload.
        catalog = self.registry.scan()
        with self._lock:
            if self._closing.is_set():
                return
            removals = not catalog.errors
            if self._said("listing", "; ".join(catalog.errors)):  # once per outage, not once per poll
                for error in catalog.errors:
                    log.warning("polling the model repository: %s; nothing is unloaded until it can be listed", error)
            for name in sorted(set(catalog.models) | set(self.registry.names())):
                if name not in catalog.models:
                    if removals:
                        log.info("model %r is no longer in the repository: unloading it", name)
                        retired += self._remove(name, self.registry.versions(name))
                        self._notify(name, None)
                    continue
                try:
                    plan = self.registry.plan(name, catalog)
                except NeuropodError as e:
                    self._failed_all(name, e)
                    if self._said(f"model {name}", str(e)):
                        log.error("model %r: %s", name, e)
                    continue
                self._said(f"model {name}", "")
                done, _ = self._apply(name, plan, catalog, None, force=False, removals=removals)
                retired += done
            self._update_loaded()
        self._retire(retired, drain_s)

    def _said(self, about: str, message: str) -> bool:
        """Whether ``message`` about ``about`` is new since the last poll ("": nothing to say now)."""
        if self._poll_said.get(about, "") == message:
            return False
        self._poll_said[about] = message
        return bool(message)

    def start_polling(self, interval_s: float) -> None:
        """Call :meth:`poll` every ``interval_s`` seconds on a thread of its own, until :meth:`close`."""
        if interval_s <= 0:
            raise ValueError(f"the poll interval is a number of seconds above 0, not {interval_s}")
        self.poll_interval_s = interval_s

        def run() -> None:
            while not self._closing.wait(interval_s):
                try:
                    self.poll()
                except Exception:  # a poll's bug must not stop the next one
                    log.exception("polling the model repository failed")

        self._poller = threading.Thread(target=run, name="neuropod-repository-poll", daemon=True)
        self._poller.start()

    def _apply(
        self, name: str, plan: dict[str, Found], catalog: Catalog, settings: ModelSettings | None, *,
        force: bool, removals: bool = True,
    ) -> tuple[list[tuple[ServedModel, _Runner | None]], list[str]]:  # fmt: skip
        """Make the loaded versions of ``name`` those of ``plan`` (with the engine's lock held).

        :param force: load every version of the plan again; else only those new or changed
            (and not those whose unchanged files failed before).
        :param removals: unload the loaded versions the repository no longer holds.
        :returns: the models replaced or dropped, with their runners (for :meth:`_retire`),
            and the failures of the plan's versions.
        """
        registry = self.registry
        options = registry.load_options if settings is None else registry.options_for(settings)
        retired: list[tuple[ServedModel, _Runner | None]] = []
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
            except NeuropodError as e:
                kept = f"; still serving the model loaded before from {current.where}" if current is not None else ""
                registry.failed(name, version, f"the last load failed: {e}{kept}", found.stamp)
                if not force:
                    log.error("loading version %s of model %r failed: %s%s", version, name, e, kept)
                failures.append(f"version {version}: {e}" if version != MODEL_VERSION else str(e))
                continue
            served.settings = settings
            old = registry.put(served)
            old_runner = self._runners.get((name, version))
            self._start(served)
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

    def _remove(self, name: str, versions: Iterable[str]) -> list[tuple[ServedModel, _Runner | None]]:
        """Stop serving those versions of ``name`` (with the engine's lock held); close them with :meth:`_retire`."""
        return [(self.registry.remove(name, v), self._runners.pop((name, v), None)) for v in list(versions)]

    def _retire(self, retired: list[tuple[ServedModel, _Runner | None]], drain_s: float) -> None:
        """Close models no longer served, once the requests running or queued on them finished
        (for up to ``drain_s`` seconds each)."""
        for old, runner in retired:
            if runner is not None:
                if runner.batcher is not None:
                    runner.batcher.close()
                if not runner.gate.drain(drain_s):
                    log.warning("model %r version %s stopped serving while requests still ran on it after %g s",
                                old.name, old.version, drain_s)  # fmt: skip
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
        runner.executor.shutdown(wait=False)

    def _update_loaded(self) -> None:
        self.metrics.loaded(len(self.registry))

    def close(self) -> None:
        """Stop every batcher and thread (the repository poll's too) and close every model."""
        self._closing.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join()
        with self._lock:
            runners = list(self._runners.values())
            for key in list(self._runners):
                self._stop(key)
            for runner in runners:
                runner.executor.shutdown(wait=True)
            self.registry.close()
            if self.shared_memory is not None:
                self.shared_memory.close()

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
        :raises ModelBusyError: the model's queue is full (:class:`ModelLimits`).
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
                        and _nbytes(inputs) <= runner.inline_bytes
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
                and _nbytes(inputs) <= runner.inline_bytes
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
                    raise UnknownModelError(f"model {served.name!r} was unloaded while the request waited") from None
                outputs = await future
            return _ordered(runner, outputs, requested)
        except (SpecError, ModelBusyError):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
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
                        outputs = _wait(future, _deadline(queued, None, time_left), served.name, queued, "its batch")
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
                    deadline = _deadline(queued, None, time_left)
                    outputs = self._run_queued(runner, inputs, requested, queued, deadline)
            return _ordered(runner, outputs, requested)
        except (SpecError, ModelBusyError, RequestTimeoutError):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise

    # -- requests with options (a timeout, classification, parameters) ---------------------
    # Apart from the plain path above, so that a plain request pays nothing for them.

    async def _infer_with(
        self, runner: _Runner, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None,
        options: RequestOptions,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """:meth:`infer` of a request with options: never on the event loop; a request still
        waiting (for a thread, a run slot or its batch) when its timeout passes is not run."""
        classes = _classification(runner, served, requested, options)
        queued = time.perf_counter()
        deadline = _deadline(queued, options, None)
        gate = runner.gate
        try:
            if runner.batcher is not None:
                self.check(served, inputs, requested)
                gate.admit(False)
                try:
                    future = runner.batcher.submit(inputs, requested, options.parameters)
                    outputs = await _until(future, deadline, served.name, queued, "its batch")
                finally:
                    gate.leave(False)
            else:
                self._check_missing(runner, inputs)
                gate.admit(False)
                try:
                    future = runner.executor.submit(
                        self._run_queued, runner, inputs, requested, queued, deadline, options.parameters
                    )
                except RuntimeError:  # the model's threads stopped: it is being unloaded
                    gate.leave(False)
                    raise UnknownModelError(f"model {served.name!r} was unloaded while the request waited") from None
                try:
                    outputs = await _until(future, deadline, served.name, queued, "a thread")
                except _NotStarted as e:
                    gate.leave(False)  # it never reached _run_queued, which would have
                    raise e.error from None
        except (SpecError, ModelBusyError, RequestTimeoutError):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise
        ordered = _ordered(runner, outputs, requested)
        return classes.apply(ordered) if classes is not None else ordered

    def _infer_blocking_with(
        self, runner: _Runner, served: ServedModel, inputs: dict[str, np.ndarray], requested: list[str] | None,
        options: RequestOptions, time_left: Callable[[], float | None] | None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """:meth:`infer_blocking` of a request with options (see :meth:`_infer_with`)."""
        classes = _classification(runner, served, requested, options)
        queued = time.perf_counter()
        gate = runner.gate
        try:
            if runner.batcher is not None:
                self.check(served, inputs, requested)
                deadline = _deadline(queued, options, time_left)
                gate.admit(False)
                try:
                    future = runner.batcher.submit(inputs, requested, options.parameters)
                    outputs = _wait(future, deadline, served.name, queued, "its batch")
                finally:
                    gate.leave(False)
            else:
                self._check_missing(runner, inputs)
                if gate.admit(True):
                    try:
                        outputs = self._run(runner, inputs, requested, None, options.parameters)
                    finally:
                        gate.leave(True)
                else:
                    deadline = _deadline(queued, options, time_left)
                    outputs = self._run_queued(runner, inputs, requested, queued, deadline, options.parameters)
        except (SpecError, ModelBusyError, RequestTimeoutError):
            raise
        except NeuropodError as e:
            if self._runners.get((served.name, served.version)) is not runner:
                raise self._closed_under(runner) from e
            raise
        ordered = _ordered(runner, outputs, requested)
        return classes.apply(ordered) if classes is not None else ordered

    def _runner(self, served: ServedModel) -> _Runner:
        """The runner of ``served``, or of the model that replaced it in a reload since the
        request looked it up (its spec checks apply then)."""
        runner = self._runners.get((served.name, served.version))
        if runner is None:
            raise UnknownModelError(f"model {served.name!r} was unloaded while the request waited")
        return runner

    @staticmethod
    def _closed_under(runner: _Runner) -> UnknownModelError:
        """What a NeuropodError (not a SpecError or ModelBusyError) raised while ``runner``
        served a request becomes when the model was closed or replaced under the request
        (its batcher stopped, or the model): then it is not the model's failure. Each
        caller checks in its own ``except`` (not a context manager: this is on every
        request's path)."""
        return UnknownModelError(f"model {runner.served.name!r} was unloaded while the request ran")

    def _run_queued(
        self, runner: _Runner, inputs: dict[str, np.ndarray], requested: list[str] | None, queued: float,
        deadline: _Deadline | None = None, parameters: Mapping[str, Any] | None = None,
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
            return self._run(runner, inputs, requested, queued, parameters)
        finally:
            gate.leave(True)

    def _run(
        self, runner: _Runner, inputs: dict[str, np.ndarray], requested: list[str] | None, queued: float | None,
        parameters: Mapping[str, Any] | None = None,
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
        collected = _FullCollections.seconds
        ok = False
        try:
            if parameters is None:
                outputs = runner.served.model.infer(inputs, requested)
            else:
                outputs = runner.served.model.infer(inputs, requested, parameters=parameters)
            ok = True
            return outputs
        finally:
            seconds = _learn(runner, inputs, started, cpu, collected, queued is not None)
            if ok:
                self.metrics.ran(
                    runner.served.name, 0.0 if queued is None else begun - queued, seconds, started - begun
                )

    @staticmethod
    def _timed(
        runner: _Runner, inputs: dict[str, np.ndarray], requested: list[str] | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """One run of a batched model (a batch, or a request its idle batcher runs alone): the
        model's run time, as :meth:`_run` learns it, decides whether its lone requests may run
        on the event loop. The batcher records the metrics."""
        started = time.perf_counter()
        cpu = time.thread_time()
        collected = _FullCollections.seconds
        try:
            if parameters is None:
                return runner.served.model.infer(inputs, requested)
            return runner.served.model.infer(inputs, requested, parameters=parameters)
        finally:
            _learn(runner, inputs, started, cpu, collected, True)


def _learn(
    runner: _Runner, inputs: Mapping[str, np.ndarray], started: float, cpu: float, collected: float, on_thread: bool
) -> float:
    """Learn from a run of ``runner``'s model begun at ``started`` (``cpu``: the thread's CPU
    time then, ``collected``: :class:`_FullCollections` seconds then) whether it may run on the
    event loop (:attr:`_Runner.inline_ok`, ``ewma_s``, ``inline_bytes``); the run's seconds.

    :param on_thread: the run was not on the event loop (only such runs raise ``inline_bytes``).
    """
    seconds = time.perf_counter() - started
    # The model's own time: without the full collections the run fell into (whichever thread
    # ran them, every thread waited); the metrics keep what the request took.
    ran = seconds - (_FullCollections.seconds - collected)
    # Slow on this thread's CPU too: the model's own work, not a busy core's scheduling.
    if (
        ran >= SLOW_RUN_S
        and runner.ewma_s < INLINE_BELOW_S
        and time.thread_time() - cpu - (seconds - ran) >= SLOW_RUN_S / 2
    ):
        runner.inline_ok = False
    elif on_thread and ran < INLINE_BELOW_S and runner.inline_ok:
        # Learnt on threads; a run on the loop had no larger input than this already.
        size = _nbytes(inputs)
        if size > runner.inline_bytes:
            runner.inline_bytes = size
    runner.ewma_s += _EWMA * (ran - runner.ewma_s)
    return seconds


_CALL_DEADLINE = "the call's deadline"
#: A call deadline further than this (seconds) is no deadline: MAX_TIMEOUT_US's year.
_NO_CALL_DEADLINE_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class _Deadline:
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


def _deadline(
    now: float, options: RequestOptions | None, time_left: Callable[[], float | None] | None
) -> _Deadline | None:
    """The earlier of the request's ``timeout`` and the call's own deadline (None: neither)."""
    best = None
    if options is not None and options.timeout_s is not None:
        best = _Deadline(now + options.timeout_s, f"its timeout of {options.timeout_us} µs")
    left = time_left() if time_left is not None else None
    # grpcio reports a call without a deadline as one centuries away: past a year, none
    # (waits that long overflow the clocks the waits use).
    if left is not None and left < _NO_CALL_DEADLINE_S and (best is None or now + left < best.at):
        best = _Deadline(now + left, _CALL_DEADLINE)
    return best


class _NotStarted(Exception):
    """A request's work was cancelled before it started (its deadline passed first)."""

    def __init__(self, error: RequestTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


async def _until(
    future: concurrent.futures.Future[Any], deadline: _Deadline | None, model: str, queued: float, waiting_for: str
) -> Any:
    """The result of ``future`` (a batch's, or a run handed to a thread); when ``deadline``
    passes before it starts, it is cancelled (never run) and a RequestTimeoutError raised
    (as :class:`_NotStarted` for a thread's run, whose gate the caller leaves). Work already
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
                raise _NotStarted(error) from None
            raise error from None
        return await wrapped


def _wait(
    future: concurrent.futures.Future[Any], deadline: _Deadline | None, model: str, queued: float, waiting_for: str
) -> Any:
    """:func:`_until` for a caller on a thread of its own."""
    if deadline is None:
        return future.result()
    try:
        return future.result(timeout=max(0.0, deadline.at - time.perf_counter()))
    except concurrent.futures.TimeoutError:
        if future.cancel():
            raise deadline.expired(model, queued, waiting_for) from None
        return future.result()


def _classification(
    runner: _Runner, served: ServedModel, requested: list[str] | None, options: RequestOptions
) -> Classifier | None:
    """The classification a request asks (checked before it runs), or None."""
    if options.classification is None:
        return None
    return Classifier.of(served, options.classification, requested)


def _nbytes(inputs: Mapping[str, np.ndarray]) -> int:
    """The size of the first input (0 for none): what :attr:`_Runner.inline_bytes` compares."""
    for a in inputs.values():
        return int(a.nbytes)
    return 0


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
