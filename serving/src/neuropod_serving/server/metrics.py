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
  (once per batch);
- ``neuropod_batch_size{model}``: rows (along the batch dimension) per run;
- ``neuropod_models_loaded``.
"""

from __future__ import annotations

from typing import Any

#: Seconds: 50 µs to 10 s, dense where a small model's latency lies.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The counters and histograms of one server; thread-safe (prometheus-client locks)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "neuropod_requests", "Inference requests received", ["model", "protocol"], registry=r
        )
        self.failures = Counter(
            "neuropod_request_failures",
            "Inference requests that failed, by who caused it: client (bad request) or model",
            ["model", "protocol", "reason"],
            registry=r,
        )
        self.request_duration = Histogram(
            "neuropod_request_duration_seconds",
            "Time from a request reaching the server's handler to its reply being encoded",
            ["model", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "neuropod_queue_duration_seconds",
            "Time a request waited for a batch or a free thread before its model ran",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "neuropod_compute_duration_seconds",
            "Time of one model run (one per batch when batching)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "neuropod_batch_size",
            "Rows along the batch dimension per model run",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.models_loaded = Gauge("neuropod_models_loaded", "Models loaded and ready", registry=r)
        # Children by label tuple: labels() costs a lock and a dict lookup each call.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None:
        """One request done: ``failure`` is None, ``"client"`` or ``"model"``."""
        self._child(self.requests, model, protocol).inc()
        self._child(self.request_duration, model, protocol).observe(seconds)
        if failure is not None:
            self._child(self.failures, model, protocol, failure).inc()

    def queued(self, model: str, seconds: float) -> None:
        self._child(self.queue_duration, model).observe(seconds)

    def computed(self, model: str, seconds: float, rows: int | None) -> None:
        self._child(self.compute_duration, model).observe(seconds)
        if rows is not None:
            self._child(self.batch_size, model).observe(rows)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class NoMetrics:
    """Records nothing: for an Engine built without metrics (tests, embedding)."""

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None:
        pass

    def queued(self, model: str, seconds: float) -> None:
        pass

    def computed(self, model: str, seconds: float, rows: int | None) -> None:
        pass
