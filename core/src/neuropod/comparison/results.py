"""What ``neuropod compare`` finds, as plain objects that turn into JSON (``Comparison.to_dict``).

Every figure the terminal table, ``--json`` and ``--html`` show is a field here; times are
seconds, memory bytes, throughput items (rows of the batch axis) per second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

#: Exit statuses of ``neuropod compare``: every candidate agrees (and is fast enough), or some
#: candidate disagrees, failed or is too slow. (A command that cannot run exits with the CLI's
#: ``EXIT_ERROR``, 2.)
EXIT_AGREE, EXIT_DISAGREE = 0, 1

#: Verdicts of a candidate against the baseline.
BASELINE, AGREES, DISAGREES, FAILED, NOT_COMPARED = "baseline", "agrees", "disagrees", "failed", "not compared"


@dataclass
class Worst:
    """One element of an output that differs from the baseline's."""

    input_set: int
    index: list[int]
    value: Any
    baseline: Any
    abs_error: float | None = None
    rel_error: float | None = None


@dataclass
class OutputAgreement:
    """How one output of a candidate compares with the baseline's, over every input set.

    ``exact`` outputs (strings, bytes, integers, booleans) agree only when equal; float outputs
    agree when every element is within ``atol + rtol * |baseline|`` (numpy's ``isclose``, NaN equal
    to NaN). ``problem`` says why the output could not be compared element by element (a shape or
    dtype that differs, a missing output): such an output disagrees.
    """

    name: str
    dtype: str
    exact: bool
    elements: int = 0
    outside: int = 0
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    worst: list[Worst] = field(default_factory=list)
    problem: str | None = None

    @property
    def agrees(self) -> bool:
        return self.problem is None and self.outside == 0

    @property
    def share_outside(self) -> float:
        return self.outside / self.elements if self.elements else 0.0


@dataclass
class Latency:
    """Latency percentiles of calls one at a time (SingleStream), or at a target arrival rate
    (Server: each call's time counts from when it was due, so waiting for a free slot counts)."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float
    stdev: float
    min: float
    max: float
    #: Every call's latency, or an even sample of at most :data:`SAMPLES_KEPT` of them (for charts).
    samples: list[float] = field(default_factory=list)
    #: Server scenario only: the rate asked for and the rate reached (calls per second).
    rate: float | None = None
    achieved_rate: float | None = None


#: How many latency samples a result keeps for its charts.
SAMPLES_KEPT = 2000


@dataclass
class Throughput:
    """Offline: calls of ``batch_size`` rows back to back, for the measurement's duration."""

    batch_size: int
    calls: int
    seconds: float
    items_per_s: float
    p50: float


@dataclass
class Memory:
    """Peak resident memory of the candidate's process and its workers, before and after loading."""

    rss_before_load: int | None = None
    peak_rss: int | None = None
    #: Peak GPU memory the candidate's processes held, through NVML (None without an NVIDIA GPU).
    gpu_bytes: int | None = None
    note: str | None = None

    @property
    def added_rss(self) -> int | None:
        if self.peak_rss is None or self.rss_before_load is None:
            return None
        return max(0, self.peak_rss - self.rss_before_load)


@dataclass
class CandidateResult:
    """One candidate: what ran, how fast, how much memory, and how its outputs compare."""

    label: str
    #: The candidate as given (``adder.neuropod@onnx==1.20.1``).
    given: str
    target: str
    backend_pin: str | None = None
    device_pin: str | None = None
    use_ope: bool = False
    remote: bool = False
    #: ``"ok"``, or ``"failed"`` with ``error`` and the ``stage`` it failed at (``load``, ``run``, ``measure``).
    status: str = "ok"
    error: str | None = None
    stage: str | None = None
    model_name: str | None = None
    backend: str | None = None
    #: The framework's distribution and version, e.g. ``onnxruntime 1.31.1``.
    framework: str | None = None
    location: str | None = None
    device: str | None = None
    package_bytes: int | None = None
    load_s: float | None = None
    latency: Latency | None = None
    throughput: list[Throughput] = field(default_factory=list)
    server: Latency | None = None
    memory: Memory = field(default_factory=Memory)
    verdict: str = NOT_COMPARED
    outputs: list[OutputAgreement] = field(default_factory=list)
    #: p50 latency against the baseline's (1.0: as fast; 2.0: twice as slow).
    slowdown: float | None = None
    #: Notes for the reader (a measurement skipped, and why).
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Comparison:
    """The result of :func:`neuropod.compare`: every candidate, the inputs they ran on, the settings,
    the machine, and the verdict."""

    candidates: list[CandidateResult]
    settings: dict[str, Any]
    #: Where the inputs came from (``test data of LABEL``, files, generated) and their shapes.
    inputs: dict[str, Any]
    #: Notes of the spec check (symbols named differently, maps applied).
    problem_notes: list[str]
    machine: dict[str, Any]
    command: str
    date: str
    neuropod_version: str
    #: How candidates were run, for the reader of a report.
    method: str

    @property
    def baseline(self) -> CandidateResult:
        return self.candidates[0]

    @property
    def slow(self) -> list[CandidateResult]:
        """Candidates slower at p50 than ``max_slowdown`` times the baseline."""
        limit = self.settings.get("max_slowdown")
        if limit is None:
            return []
        return [c for c in self.candidates[1:] if c.slowdown is not None and c.slowdown > limit]

    @property
    def passed(self) -> bool:
        """Every candidate ran and agrees with the baseline (and none is too slow)."""
        return all(c.verdict in (BASELINE, AGREES) for c in self.candidates) and not self.slow

    @property
    def exit_code(self) -> int:
        return EXIT_AGREE if self.passed else EXIT_DISAGREE

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for c, raw in zip(self.candidates, data["candidates"]):
            raw["memory"]["added_rss"] = c.memory.added_rss
            for o, out in zip(c.outputs, raw["outputs"]):
                out["agrees"] = o.agrees
                out["share_outside"] = o.share_outside
        data["passed"] = self.passed
        data["exit_code"] = self.exit_code
        data["slow"] = [c.label for c in self.slow]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_plain, allow_nan=False)


def _plain(value: Any) -> Any:
    """JSON for what ``json`` does not know: numpy scalars, bytes (as latin-1 text), anything else as text."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return str(value)
