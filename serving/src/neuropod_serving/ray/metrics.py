"""``neuropod serve``'s metrics on Ray Serve: recorded through Ray's metrics, per replica."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from neuropod_serving.server.metrics import BATCH_BUCKETS, LATENCY_BUCKETS

#: A pipeline's per-step statistics (:meth:`neuropod.pipelines.PipelineModel.step_statistics`).
StepStatistics = Callable[[], Mapping[str, Mapping[str, int]]]


class RayMetrics:
    """``neuropod serve``'s metrics (same names, same buckets) recorded through Ray's metrics,
    tagged with the replica: each node's metrics agent exports them to Prometheus.

    Ray prefixes application metrics with ``ray_`` when it exports them
    (``ray_neuropod_requests_total{model,protocol,replica,...}``).
    """

    #: What ``GET /metrics`` on a replica answers (with 404): one replica's numbers behind a
    #: load-balancing proxy would mislead a scraper.
    elsewhere = (
        "on Ray Serve, each replica's metrics are exported by its node's Ray metrics agent "
        "(ray_neuropod_* with a replica tag; ray start --metrics-export-port), not at /metrics"
    )

    def __init__(self, replica: str, application: str) -> None:
        from ray.util import metrics as m


        common = ("model", "replica", "application")
        self._tags = {"replica": replica, "application": application}
        latency = list(LATENCY_BUCKETS)
        self._requests = m.Counter("neuropod_requests", "Inference requests received", (*common, "protocol"))
        self._failures = m.Counter(
            "neuropod_request_failures",
            "Inference requests that failed, by who caused it: client (bad request) or model",
            (*common, "protocol", "reason"),
        )
        self._request_duration = m.Histogram(
            "neuropod_request_duration_seconds",
            "Time from a request reaching the replica's handler to its reply being encoded",
            latency,
            (*common, "protocol"),
        )
        self._queue = m.Histogram(
            "neuropod_queue_duration_seconds",
            "Time a request waited for a batch or a free thread before its model ran",
            latency,
            common,
        )
        self._compute = m.Histogram(
            "neuropod_compute_duration_seconds", "Time of one model run (one per batch when batching)", latency, common
        )
        self._batch = m.Histogram(
            "neuropod_batch_size", "Rows along the batch dimension per model run", list(BATCH_BUCKETS), common
        )
        self._first_response = m.Histogram(
            "neuropod_stream_first_response_seconds", "Time from a stream's request to its first response", latency,
            common,
        )
        self._response_gap = m.Histogram(
            "neuropod_stream_response_gap_seconds", "Time between one response of a stream and the next", latency,
            common,
        )
        self._loaded = m.Gauge("neuropod_models_loaded", "Models loaded and ready", ("replica", "application"))
        self._by_model: dict[str, dict[str, str]] = {}
        step = (*common, "step")
        self._step_runs = m.Counter("neuropod_pipeline_step_runs", "Runs of each step of a pipeline", step)
        self._step_failures = m.Counter(
            "neuropod_pipeline_step_failures", "Runs of a pipeline's step that failed", step
        )
        self._step_seconds = m.Counter("neuropod_pipeline_step_seconds", "Time spent in each step of a pipeline", step)
        #: model -> (its step statistics, what was exported of them so far).
        self._pipelines: dict[str, tuple[StepStatistics, dict[str, dict[str, int]]]] = {}
        self._steps_lock = threading.Lock()

    def watch_steps(self, model: str, statistics: StepStatistics) -> None:
        """Export the steps of pipeline ``model`` (runs, failures, seconds per step, tagged ``step``),
        read from ``statistics`` after each of its runs."""
        self._pipelines[model] = (statistics, {})

    def steps(self, model: str) -> None:
        """Export what pipeline ``model``'s steps did since the last time (nothing for another model).
        Called after each of its runs here; the deployment calls it after a handle call that failed."""
        watched = self._pipelines.get(model)
        if watched is None:
            return
        statistics, exported = watched
        with self._steps_lock:
            for step, now in statistics().items():
                before = exported.setdefault(step, {"count": 0, "failures": 0, "ns": 0})
                tags = {**self._model(model), "step": step}
                if now["count"] > before["count"]:
                    self._step_runs.inc(now["count"] - before["count"], tags)
                if now["failures"] > before["failures"]:
                    self._step_failures.inc(now["failures"] - before["failures"], tags)
                if now["ns"] > before["ns"]:
                    self._step_seconds.inc((now["ns"] - before["ns"]) / 1e9, tags)
                exported[step] = dict(now)

    def _model(self, model: str) -> dict[str, str]:
        tags = self._by_model.get(model)
        if tags is None:
            tags = self._by_model[model] = {**self._tags, "model": model}
        return tags

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None:
        tags = {**self._model(model), "protocol": protocol}
        self._requests.inc(1, tags)
        self._request_duration.observe(seconds, tags)
        if failure is not None:
            self._failures.inc(1, {**tags, "reason": failure})
        self.steps(model)

    def queued(self, model: str, seconds: float) -> None:
        self._queue.observe(seconds, self._model(model))

    def ran(self, model: str, queued: float, seconds: float, prepared: float = 0.0) -> None:
        tags = self._model(model)
        self._queue.observe(queued, tags)
        self._compute.observe(seconds, tags)
        self.steps(model)

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
        # Triton's statistics (the other arguments) are not kept on Ray Serve: one replica's
        # numbers behind a load-balancing proxy would mislead, as /metrics would.
        tags = self._model(model)
        for w in waited:  # each request's wait in the queue, as queued() records one
            self._queue.observe(w, tags)
        self._compute.observe(seconds, tags)
        if rows is not None:
            self._batch.observe(rows, tags)
        self.steps(model)

    def streamed(self, model: str, seconds: float, first: bool, index: int | None = None, failed: bool = False) -> None:
        # Triton's per-response statistics (index, failed) are not kept on Ray Serve, as in computed().
        if not failed:
            (self._first_response if first else self._response_gap).observe(seconds, self._model(model))

    def stream_ended(self, model: str, seconds: float) -> None:
        self._compute.observe(seconds, self._model(model))  # one run of the model, as ran() records one
        self.steps(model)

    def loaded(self, count: int) -> None:
        self._loaded.set(count, self._tags)
