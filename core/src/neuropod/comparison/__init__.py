"""``neuropod compare``: one problem, many implementations, compared for agreement, speed and memory.

``neuropod.compare(["adder.onnx.neuropod", "adder.torch.neuropod@cpu"])`` returns a
:class:`Comparison`; ``neuropod compare`` prints its table and writes ``--json`` and ``--html``.
"""

from __future__ import annotations

from neuropod.comparison.candidates import Candidate, parse_candidate
from neuropod.comparison.problem import ProblemMismatch
from neuropod.comparison.results import (
    CandidateResult,
    Comparison,
    Latency,
    Memory,
    OutputAgreement,
    Throughput,
    Worst,
)
from neuropod.comparison.runner import compare

__all__ = [
    "Candidate",
    "CandidateResult",
    "Comparison",
    "Latency",
    "Memory",
    "OutputAgreement",
    "ProblemMismatch",
    "Throughput",
    "Worst",
    "compare",
    "parse_candidate",
]
