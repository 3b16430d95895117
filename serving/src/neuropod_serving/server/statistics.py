"""Triton's statistics extension: per-model counts and durations in Triton's schema.

The numbers are the ones ``GET /metrics`` exports, read from its histograms
(request, queue and compute durations) or recorded by the same calls of
:class:`~neuropod_serving.server.metrics.ServerMetrics` under the same lock, so
the two never disagree. What the histograms do not hold is kept beside them:
when a model's last request was answered (a clock read and a dict store per
request), failed requests' time, copies of read-only inputs, and each batch's
size, request count and input/output times (a few counters per failure, copy
or batch; an unbatched run that succeeds adds nothing). This module builds
Triton's answer from them.

What each duration means here, per request (``inference_stats``):

- ``success`` / ``fail``: requests that were answered with outputs / with an
  error, from the handler receiving them to their encoded reply (the
  ``neuropod_request_duration_seconds`` histogram, split by outcome).
- ``queue``: waiting for a run slot or for a batch to run
  (``neuropod_queue_duration_seconds``).
- ``compute_input``: making the model's inputs from the decoded request:
  concatenating a batch, or copying read-only inputs so the model gets
  writable arrays (only an engine caller's own: the front ends decode into
  writable memory). Decoding the request is not in it: like Triton's front
  end, it is part of ``success`` only (perf_analyzer's "overhead").
- ``compute_infer``: the model's ``infer`` call (its spec checks and the
  framework's run) (``neuropod_compute_duration_seconds``).
- ``compute_output``: splitting a batch's outputs back per request; 0 for a
  run of one request, whose outputs are handed over as they are. Encoding the
  reply is front-end work, part of ``success`` only.

``response_stats`` (Triton's statistics per response of a decoupled model,
keyed by the response's index in its stream: ``"0"`` the first, ``"1"`` the
next...) holds, for the first :data:`RESPONSE_STATS_KEYS` indices, the
responses produced (``success`` and ``compute_infer``: the time to make that
response, since the stream opened or since the response before) and the
streams that failed there (``fail``: the model raised, or its response broke
the spec). ``compute_output`` counts the same responses with no time of its
own: a response's spec check is part of making it. ``empty_response`` and
``cancel`` are 0: an empty final response is the front end's, not the
model's, and a cancelled stream's generator closes at once. The key is left
out until a model has streamed. Every response, past those indices too, is in
the ``neuropod_stream_*`` histograms of ``/metrics``.

A request that ran in a batch counts the batch's compute durations, as in
Triton. ``batch_stats`` count model runs by batch size (rows); a model that
is not batched runs one request at a time, counted as batch size 1, and its
``inference_count`` grows by one a request (its configuration says
``max_batch_size: 0``). Only successful runs are counted. ``cache_hit`` and
``cache_miss`` are always 0: there is no response cache.

A pipeline's steps are not models of their own, yet are reported as Triton reports an ensemble's
composing models: after the pipeline's entry, one entry per step named ``<pipeline>/<step>``
(:func:`step_statistics`), with its successful calls and their time (``success``,
``compute_infer``) and its failures (``fail``). The pipeline's own entry counts its requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neuropod_serving.protocol._grpc import triton_config_pb2

#: What a statistics request gets from an engine that keeps none (its metrics are not a
#: ServerMetrics); the extension is then not listed either.
NO_STATISTICS = (
    "this server keeps no statistics: neuropod serve keeps them with its metrics, but this engine was "
    "built without them, or runs on Ray Serve (where each replica's metrics go to Ray's metrics agents)"
)

#: Response indices ``response_stats`` keeps, per model ("0" to "255"): a stream of many thousand
#: responses must not grow the statistics without end.
RESPONSE_STATS_KEYS = 256
#: The durations of a ``response_stats`` entry, in Triton's order.
RESPONSE_DURATIONS = ("compute_infer", "compute_output", "success", "fail", "empty_response", "cancel")

#: The per-request durations of ``inference_stats``, in Triton's order.
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class ModelStats:
    """A model's failed requests and batched runs, which its statistics need beyond
    Prometheus' histograms; updated under :class:`ServerMetrics`' lock, and only by a
    failure or a batch (an unbatched run that succeeds costs nothing here). Seconds are
    floats, turned into ns when read."""

    __slots__ = (
        "batch_infer", "batch_input", "batch_output", "batched", "batched_requests", "batched_rows",
        "fail_n", "fail_s", "responses",
    )  # fmt: skip

    def __init__(self) -> None:
        self.fail_n = 0
        self.fail_s = 0.0
        #: Batched runs by rows: [runs, input s, infer s, output s].
        self.batched: dict[int, list[Any]] = {}
        self.batched_rows = 0
        self.batched_requests = 0
        # Per request of a batch: the batch's input, infer and output seconds, summed.
        self.batch_input = 0.0
        self.batch_infer = 0.0
        self.batch_output = 0.0
        #: Streams' responses by index: [produced, seconds, failed, seconds].
        self.responses: dict[int, list[Any]] = {}

    def response(self, index: int, seconds: float, failed: bool) -> None:
        """A stream's response ``index`` produced in ``seconds`` (or, ``failed``, its model failed there)."""
        entry = self.responses.get(index)
        if entry is None:
            entry = self.responses[index] = [0, 0.0, 0, 0.0]
        at = 2 if failed else 0
        entry[at] += 1
        entry[at + 1] += seconds

    def batch(self, rows: int, requests: int, prepared: float, seconds: float, extracted: float) -> None:
        """One batched run of ``requests`` requests, ``rows`` rows in all."""
        entry = self.batched.get(rows)
        if entry is None:
            entry = self.batched[rows] = [0, 0.0, 0.0, 0.0]
        entry[0] += 1
        entry[1] += prepared
        entry[2] += seconds
        entry[3] += extracted
        self.batched_rows += rows
        self.batched_requests += requests
        self.batch_input += requests * prepared
        self.batch_infer += requests * seconds
        self.batch_output += requests * extracted


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _duration(count: int, seconds: float) -> dict[str, int]:
    return {"count": count, "ns": _ns(seconds)}


def model_statistics(
    name: str,
    version: str,
    stats: ModelStats | None,
    *,
    last_s: float,
    requests: tuple[int, float],
    queue: tuple[int, float],
    runs: tuple[int, float],
    run_input: float,
) -> dict[str, Any]:
    """One ``$model_stat`` of Triton's statistics response.

    :param stats: the model's failures and batched runs (None: none recorded yet).
    :param last_s: when its last request was answered (``time.time()``; 0 before any).
    :param requests: requests of the model answered (with outputs or an error), on every
        protocol, and their seconds summed: the request histograms'.
    :param queue: the waits recorded (count, seconds summed): the queue histogram's.
    :param runs: the successful runs, batched or not (count, seconds summed): the compute histogram's.
    :param run_input: seconds copying inputs before unbatched runs, summed.
    """
    s = stats if stats is not None else ModelStats()
    runs_by_size: dict[int, list[Any]] = {rows: list(entry) for rows, entry in s.batched.items()}
    # Unbatched runs (one request each) are the compute histogram's runs that were not batches.
    single = runs[0] - sum(entry[0] for entry in s.batched.values())
    single_s = runs[1] - sum(entry[2] for entry in s.batched.values())
    if single:
        one = runs_by_size.setdefault(1, [0, 0.0, 0.0, 0.0])
        one[0] += single
        one[1] += run_input
        one[2] += single_s
    per_request = single + s.batched_requests
    zero = _duration(0, 0.0)
    stat: dict[str, Any] = {
        "name": name,
        "version": version,
        "last_inference": round(last_s * 1000),
        "inference_count": single + s.batched_rows,
        "execution_count": runs[0],
        "inference_stats": {
            "success": _duration(requests[0] - s.fail_n, requests[1] - s.fail_s),
            "fail": _duration(s.fail_n, s.fail_s),
            "queue": _duration(*queue),
            "compute_input": _duration(per_request, run_input + s.batch_input),
            "compute_infer": _duration(per_request, single_s + s.batch_infer),
            "compute_output": _duration(per_request, s.batch_output),
            "cache_hit": zero,
            "cache_miss": dict(zero),
        },
        "batch_stats": [
            {
                "batch_size": rows,
                "compute_input": _duration(n, prepared),
                "compute_infer": _duration(n, seconds),
                "compute_output": _duration(n, extracted),
            }
            for rows, (n, prepared, seconds, extracted) in sorted(runs_by_size.items())
        ],
    }
    if s.responses:
        stat["response_stats"] = {
            str(index): {
                "compute_infer": _duration(n, seconds),
                "compute_output": _duration(n, 0.0),
                "success": _duration(n, seconds),
                "fail": _duration(failed, failed_s),
                "empty_response": dict(zero),
                "cancel": dict(zero),
            }
            for index, (n, seconds, failed, failed_s) in sorted(s.responses.items())
        }
    return stat


def step_statistics(stat: dict[str, Any], steps: Mapping[str, Mapping[str, int]]) -> list[dict[str, Any]]:
    """The ``$model_stat`` entries of a pipeline's steps, named ``<pipeline>/<step>`` (after the
    pipeline's own ``stat``): each step's successful calls (``count``, ``ns``: ``success`` and
    ``compute_infer``) and failures (``fail``, no time), from ``PipelineModel.step_statistics()``."""
    zero = _duration(0, 0.0)
    out = []
    for step, counts in steps.items():
        n, ns, failed = int(counts.get("count", 0)), int(counts.get("ns", 0)), int(counts.get("failures", 0))
        done = {"count": n, "ns": ns}
        out.append({
            "name": f"{stat['name']}/{step}", "version": stat["version"], "last_inference": stat["last_inference"],
            "inference_count": n, "execution_count": n,
            "inference_stats": {
                "success": done, "fail": {"count": failed, "ns": 0}, "queue": {"count": n, "ns": 0},
                "compute_input": {"count": n, "ns": 0}, "compute_infer": dict(done),
                "compute_output": {"count": n, "ns": 0}, "cache_hit": zero, "cache_miss": dict(zero),
            },
            "batch_stats": [],
        })  # fmt: skip
    return out


def served_statistics(metrics: Any, models: Iterable[Any]) -> list[dict[str, Any]]:
    """The ``model_stats`` of ``models`` (served models) as ``metrics`` (a ServerMetrics) keeps them:
    each model's entry, and after a pipeline's, its steps' (:func:`step_statistics`)."""
    out: list[dict[str, Any]] = []
    for served in models:
        stat = metrics.statistics(served.name, served.version)
        out.append(stat)
        read = getattr(served.model, "step_statistics", None)
        if read is not None:
            out += step_statistics(stat, read())
    return out


def statistics_response(model_stats: list[dict[str, Any]]) -> triton_config_pb2.ModelStatisticsResponse:
    """The gRPC ModelStatisticsResponse of REST's ``{"model_stats": [...]}`` entries."""
    # lazy: protobuf, kept out of a REST-only server (the REST app imports this module)
    from neuropod_serving.protocol._grpc import triton_config_pb2 as tc

    def duration(d: dict[str, int]) -> Any:
        return tc.StatisticDuration(count=d["count"], ns=d["ns"])

    out = tc.ModelStatisticsResponse()
    for m in model_stats:
        entry = out.model_stats.add(
            name=m["name"],
            version=m["version"],
            last_inference=m["last_inference"],
            inference_count=m["inference_count"],
            execution_count=m["execution_count"],
        )
        for key in DURATIONS:
            getattr(entry.inference_stats, key).CopyFrom(duration(m["inference_stats"][key]))
        for b in m["batch_stats"]:
            entry.batch_stats.add(
                batch_size=b["batch_size"],
                compute_input=duration(b["compute_input"]),
                compute_infer=duration(b["compute_infer"]),
                compute_output=duration(b["compute_output"]),
            )
        for key, per_response in m.get("response_stats", {}).items():
            target = entry.response_stats[key]
            for name in RESPONSE_DURATIONS:
                getattr(target, name).CopyFrom(duration(per_response[name]))
    return out
