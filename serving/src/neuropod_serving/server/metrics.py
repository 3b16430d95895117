"""Prometheus metrics of one server: what ``GET /metrics`` answers.

Each server owns a private ``CollectorRegistry`` (never prometheus-client's
global one), so two servers in one process, or a test that starts several,
never share or clash on counters.

Names follow Prometheus' conventions (base units, ``_total`` counters):

- ``neuropod_requests_total{model,protocol}`` and
  ``neuropod_request_failures_total{model,protocol,reason}``, reason being
  ``client`` (4xx / INVALID_ARGUMENT...) or ``model`` (the model failed);
- ``neuropod_request_duration_seconds{model,protocol}``: from the request's
  arrival at the handler to its encoded reply;
- ``neuropod_queue_duration_seconds{model}``: waiting for a batch or a thread;
- ``neuropod_compute_duration_seconds{model}``: the model's ``infer`` call
  (once per batch), for runs that succeeded;
- ``neuropod_batch_size{model}``: rows (along the batch dimension) per run;
- ``neuropod_stream_first_response_seconds{model}``: from a stream's request to its
  first response (a decoupled model's stream, or any model's on a stream endpoint);
- ``neuropod_stream_response_gap_seconds{model}``: between one response of a stream
  and the next;
- ``neuropod_models_loaded``;
- ``neuropod_sequences_live{model}``: sequences of a stateful model holding state now;
- ``neuropod_pipeline_step_runs_total{model,step}``, ``neuropod_pipeline_step_failures_total{model,step}``
  and ``neuropod_pipeline_step_duration_seconds_total{model,step}``: a pipeline's steps' calls that
  succeeded, that failed, and the time of those that succeeded (``model`` is the pipeline).

The same calls keep Triton's per-model statistics
(:mod:`neuropod_serving.server.statistics`, ``GET /v2/models/stats``), so
those and these always agree.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from neuropod_serving.server.statistics import RESPONSE_STATS_KEYS, ModelStats, model_statistics

#: Seconds: 50 µs to 10 s, dense where a small model's latency lies.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("neuropod_serving.server")

#: Runs of a model in OPE workers (``--workers``) timed before the server judges whether the workers pay.
WATCHED_RUNS = 50
#: A model whose round trip to a worker takes more than this many times its run in the worker is warned about.
ROUND_TRIP_RATIO = 2.0


class _Histogram:
    """Bucket counts and a sum; cumulated only when scraped."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are "le": the first bound >= value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        from prometheus_client.utils import floatToGoString

        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return out


class ServerMetrics:
    """The counters and histograms of one server; thread-safe.

    Requests are counted in plain Python numbers under one lock (about a
    microsecond a request; prometheus-client's own metric objects cost
    several per observation) and turned into Prometheus metric families only
    when ``/metrics`` is scraped, by a collector on a private registry.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._failures: dict[tuple[str, str, str], int] = {}
        self._request_duration: dict[tuple[str, str], _Histogram] = {}
        self._queue_duration: dict[str, _Histogram] = {}
        self._compute_duration: dict[str, _Histogram] = {}
        self._batch_size: dict[str, _Histogram] = {}
        self._first_response: dict[str, _Histogram] = {}
        self._response_gap: dict[str, _Histogram] = {}
        self._loaded = 0
        # What Triton's statistics need beyond the histograms (see statistics.py).
        self._stats: dict[str, ModelStats] = {}
        self._last: dict[str, float] = {}
        self._run_input: dict[str, float] = {}
        #: Judges the first runs of models in OPE workers (``neuropod serve --workers``); None: no one does.
        self.watch: WorkerRunWatch | None = None
        #: Live sequences by stateful model, read when scraped (the engine's ``live_sequences``); None: none.
        self.live_sequences: Callable[[], dict[str, int]] | None = None
        #: Each pipeline's steps' counts, read when scraped (the registry's ``step_statistics``); None: none.
        self.step_statistics: Callable[[], dict[str, dict[str, dict[str, int]]]] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None:
        """One request done: ``failure`` is None, ``"client"`` or ``"model"``."""
        key = (model, protocol)
        with self._lock:
            self._requests[key] = self._requests.get(key, 0) + 1
            hist = self._request_duration.get(key)
            if hist is None:
                hist = self._request_duration[key] = _Histogram(LATENCY_BUCKETS)
            hist.observe(seconds)
            self._last[model] = time.time()
            if failure is not None:
                fkey = (model, protocol, failure)
                self._failures[fkey] = self._failures.get(fkey, 0) + 1
                stats = self._stats.get(model) or self._new_stats(model)
                stats.fail_n += 1
                stats.fail_s += seconds

    def _new_stats(self, model: str) -> ModelStats:
        stats = self._stats[model] = ModelStats()
        return stats

    def queued(self, model: str, seconds: float) -> None:
        with self._lock:
            _observe(self._queue_duration, model, LATENCY_BUCKETS, seconds)

    def ran(self, model: str, queued: float, seconds: float, prepared: float = 0.0) -> None:
        """One unbatched run that succeeded: ``queued`` seconds waiting for a run slot,
        ``prepared`` copying its read-only inputs, ``seconds`` in the model."""
        with self._lock:
            _observe(self._queue_duration, model, LATENCY_BUCKETS, queued)
            _observe(self._compute_duration, model, LATENCY_BUCKETS, seconds)
            if self.watch is not None:
                self.watch.observe(model, seconds)
            if prepared:  # only when read-only inputs were copied (an engine caller's own; the front ends decode writable)
                self._run_input[model] = self._run_input.get(model, 0.0) + prepared

    def computed(
        self,
        model: str,
        seconds: float,
        rows: int | None,
        requests: int = 1,
        prepared: float = 0.0,
        extracted: float = 0.0,
        waited: Sequence[float] = (),
    ) -> None:
        """One batched run that succeeded: ``requests`` requests of ``rows`` rows in all,
        ``prepared`` seconds making its inputs, ``seconds`` in the model, ``extracted``
        splitting its outputs; ``waited``: each request's wait, as :meth:`queued` records it
        (one lock for the whole batch)."""
        with self._lock:
            for w in waited:
                _observe(self._queue_duration, model, LATENCY_BUCKETS, w)
            _observe(self._compute_duration, model, LATENCY_BUCKETS, seconds)
            if self.watch is not None:
                self.watch.observe(model, seconds)
            if rows is not None:
                _observe(self._batch_size, model, BATCH_BUCKETS, rows)
            stats = self._stats.get(model) or self._new_stats(model)
            stats.batch(rows if rows is not None else requests, requests, prepared, seconds, extracted)

    def streamed(self, model: str, seconds: float, first: bool, index: int | None = None, failed: bool = False) -> None:
        """One response of a stream produced, ``seconds`` after the stream opened (``first``)
        or after the response before; ``index`` counts the stream's responses from 0. With
        ``failed``, the model failed (or broke its spec) where that response would have been:
        counted in the statistics' ``response_stats`` only, not in the histograms.

        A stream waits for no run slot and no batch: at its first response (or its failure
        before one) it is counted once in the queue histogram with 0 s, as Triton counts every
        request's time in its queue (perf_analyzer reads that count to find the model)."""
        with self._lock:
            if first:
                _observe(self._queue_duration, model, LATENCY_BUCKETS, 0.0)
            if not failed:
                _observe(self._first_response if first else self._response_gap, model, LATENCY_BUCKETS, seconds)
            if index is not None and index < RESPONSE_STATS_KEYS:
                stats = self._stats.get(model) or self._new_stats(model)
                stats.response(index, seconds, failed)

    def stream_ended(self, model: str, seconds: float) -> None:
        """A stream that made at least one response has ended: ``seconds`` in the model making
        them. Counted as one run of the model (the compute histogram; Triton's statistics'
        ``inference_count``, ``execution_count`` and ``compute_infer``), as Triton counts a
        decoupled model's request once however many responses it sends."""
        with self._lock:
            _observe(self._compute_duration, model, LATENCY_BUCKETS, seconds)

    def loaded(self, count: int) -> None:
        """How many models are loaded now."""
        self._loaded = count

    def statistics(self, model: str, version: str) -> dict[str, Any]:
        """Model ``model``'s ``$model_stat`` in Triton's statistics schema (zeros before its first request)."""
        with self._lock:
            requests, requests_s = 0, 0.0
            for (name, _), hist in self._request_duration.items():
                if name == model:
                    requests += sum(hist.counts)
                    requests_s += hist.total
            return model_statistics(
                model,
                version,
                self._stats.get(model),
                last_s=self._last.get(model, 0.0),
                requests=(requests, requests_s),
                queue=_count_and_sum(self._queue_duration.get(model)),
                runs=_count_and_sum(self._compute_duration.get(model)),
                run_input=self._run_input.get(model, 0.0),
            )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def families(self) -> list[Any]:
        """Every metric as prometheus-client metric families (a snapshot, taken under the lock)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        requests = CounterMetricFamily("neuropod_requests", "Inference requests received", labels=["model", "protocol"])
        failures = CounterMetricFamily(
            "neuropod_request_failures",
            "Inference requests that failed, by who caused it: client (bad request) or model",
            labels=["model", "protocol", "reason"],
        )
        request_duration = HistogramMetricFamily(
            "neuropod_request_duration_seconds",
            "Time from a request reaching the server's handler to its reply being encoded",
            labels=["model", "protocol"],
        )
        histograms = [
            (self._queue_duration, HistogramMetricFamily(
                "neuropod_queue_duration_seconds",
                "Time a request waited for a batch or a free thread before its model ran",
                labels=["model"],
            )),
            (self._compute_duration, HistogramMetricFamily(
                "neuropod_compute_duration_seconds", "Time of one model run (one per batch when batching)",
                labels=["model"],
            )),
            (self._batch_size, HistogramMetricFamily(
                "neuropod_batch_size", "Rows along the batch dimension per model run", labels=["model"]
            )),
            (self._first_response, HistogramMetricFamily(
                "neuropod_stream_first_response_seconds",
                "Time from a stream's request to its first response", labels=["model"],
            )),
            (self._response_gap, HistogramMetricFamily(
                "neuropod_stream_response_gap_seconds",
                "Time between one response of a stream and the next", labels=["model"],
            )),
        ]  # fmt: skip
        with self._lock:
            for key, count in self._requests.items():
                requests.add_metric(list(key), count)
            for fkey, count in self._failures.items():
                failures.add_metric(list(fkey), count)
            for key, hist in self._request_duration.items():
                request_duration.add_metric(list(key), hist.buckets(), hist.total)
            for by_model, family in histograms:
                for model, hist in by_model.items():
                    family.add_metric([model], hist.buckets(), hist.total)
            loaded = GaugeMetricFamily("neuropod_models_loaded", "Models loaded and ready", value=self._loaded)
        families = [requests, failures, request_duration, *(f for _, f in histograms), loaded]
        if self.live_sequences is not None:
            live = GaugeMetricFamily(
                "neuropod_sequences_live", "Sequences of a stateful model holding state now", labels=["model"]
            )
            for model, count in sorted(self.live_sequences().items()):
                live.add_metric([model], count)
            families.append(live)
        if self.step_statistics is not None:
            families += _step_families(self.step_statistics())
        return families


def _step_families(steps: dict[str, dict[str, dict[str, int]]]) -> list[Any]:
    """The per-step counters of pipelines (``model``: the pipeline, ``step``: its step)."""
    from prometheus_client.core import CounterMetricFamily

    labels = ["model", "step"]
    runs = CounterMetricFamily("neuropod_pipeline_step_runs", "Calls of a pipeline step's model that succeeded", labels=labels)
    failures = CounterMetricFamily("neuropod_pipeline_step_failures", "Calls of a pipeline step's model that failed",
                                   labels=labels)  # fmt: skip
    seconds = CounterMetricFamily("neuropod_pipeline_step_duration_seconds",
                                  "Time in a pipeline step's model, over its calls that succeeded", labels=labels)  # fmt: skip
    for model, by_step in sorted(steps.items()):
        for step, counts in by_step.items():
            runs.add_metric([model, step], counts["count"])
            failures.add_metric([model, step], counts["failures"])
            seconds.add_metric([model, step], counts["ns"] / 1e9)
    return [runs, failures, seconds]


class WorkerRunWatch:
    """Warns once per model run by OPE workers whose runs are much shorter than the round trip to a worker.

    A run in a worker costs a round trip on top of the model's own time: the inputs and
    outputs through shared memory, two pipe messages and a wake-up on each side (0.1 to
    1 ms, by how busy the machine is), and as much CPU again in the server. For a model
    that runs in microseconds, the server then handles fewer requests than it would
    running the model in its own process. What is measured, over a model's first
    :data:`WATCHED_RUNS` runs: their mean time as the server sees it (what
    ``neuropod_compute_duration_seconds`` records), and the mean time the backend spent
    running the model inside the workers (``WorkerModel.worker_run_time``); the
    difference is the round trip. Above :data:`ROUND_TRIP_RATIO` times the run, one warning.

    :param run_time: a model's ``worker_run_time`` (calls, seconds) now; None when it does
        not run in workers (a load's config set its workers to 1).
    :param workers: the server's ``--workers``, named in the warning.
    """

    def __init__(self, run_time: Callable[[str], tuple[int, float] | None], workers: int) -> None:
        self._run_time = run_time
        self._workers = workers
        self._watched: dict[str, tuple[tuple[int, float], list[float]]] = {}
        self._judged: set[str] = set()

    def observe(self, model: str, seconds: float) -> None:
        """One run of ``model`` took ``seconds``; called under :class:`ServerMetrics`' lock."""
        if model in self._judged:
            return
        watched = self._watched.get(model)
        if watched is None:  # the first run: the workers' clock starts after it
            start = self._measure(model)
            if start is None:
                return
            self._watched[model] = (start, [])
            return
        start, times = watched
        times.append(seconds)
        if len(times) < WATCHED_RUNS:
            return
        self._judged.add(model)
        del self._watched[model]
        end = self._measure(model)
        if end is None or end[0] <= start[0]:
            return
        in_worker = (end[1] - start[1]) / (end[0] - start[0])
        seen = sum(times) / len(times)
        trip = seen - in_worker
        if trip > ROUND_TRIP_RATIO * in_worker:
            log.warning(
                "model %r runs in %.0f us in its worker processes, but a run takes %.0f us as the server sees it "
                "(means of its first %d runs): the round trip to a worker costs %.0f us, more than twice the run, so "
                "--workers %d costs more than it gives for this model; serve it without --workers, and use "
                "--processes N to handle more requests at once", model, in_worker * 1e6, seen * 1e6, WATCHED_RUNS,
                trip * 1e6, self._workers,
            )  # fmt: skip

    def _measure(self, model: str) -> tuple[int, float] | None:
        try:
            measured = self._run_time(model)
        except Exception:  # noqa: BLE001  # unloaded since: nothing to judge
            measured = None
        if measured is None:
            self._judged.add(model)
        return measured


def _observe(by_model: dict[str, _Histogram], model: str, bounds: tuple[float, ...], value: float) -> None:
    hist = by_model.get(model)
    if hist is None:
        hist = by_model[model] = _Histogram(bounds)
    hist.observe(value)


def _count_and_sum(hist: _Histogram | None) -> tuple[int, float]:
    return (sum(hist.counts), hist.total) if hist is not None else (0, 0.0)


class _Collector:
    """What the private registry scrapes: :meth:`ServerMetrics.families`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        yield from self.metrics.families()


class Recorder(Protocol):
    """What the engine and the front ends record into: :class:`ServerMetrics`, :class:`NoMetrics`,
    or another sink with the same calls (the Ray deployment's, into Ray's metrics)."""

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None: ...

    def queued(self, model: str, seconds: float) -> None: ...

    def ran(self, model: str, queued: float, seconds: float, prepared: float = 0.0) -> None: ...

    def computed(
        self,
        model: str,
        seconds: float,
        rows: int | None,
        requests: int = 1,
        prepared: float = 0.0,
        extracted: float = 0.0,
        waited: Sequence[float] = (),
    ) -> None: ...

    def streamed(self, model: str, seconds: float, first: bool, index: int | None = None, failed: bool = False) -> None: ...

    def stream_ended(self, model: str, seconds: float) -> None: ...

    def loaded(self, count: int) -> None: ...


class NoMetrics:
    """Records nothing: for an Engine built without metrics (tests, embedding)."""

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None:
        pass

    def queued(self, model: str, seconds: float) -> None:
        pass

    def ran(self, model: str, queued: float, seconds: float, prepared: float = 0.0) -> None:
        pass

    def computed(
        self,
        model: str,
        seconds: float,
        rows: int | None,
        requests: int = 1,
        prepared: float = 0.0,
        extracted: float = 0.0,
        waited: Sequence[float] = (),
    ) -> None:
        pass

    def streamed(self, model: str, seconds: float, first: bool, index: int | None = None, failed: bool = False) -> None:
        pass

    def stream_ended(self, model: str, seconds: float) -> None:
        pass

    def loaded(self, count: int) -> None:
        pass
