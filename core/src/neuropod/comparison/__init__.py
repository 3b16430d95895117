"""``neuropod compare``: one problem, many implementations, compared for agreement, speed and memory.

``neuropod.compare(["adder.onnx.neuropod", "adder.torch.neuropod@cpu"])`` returns a
:class:`Comparison`; ``render_table(result)``, ``write_json(result, path)`` and
``write_html(result, path)`` write it out, as ``neuropod compare`` does (``--json``, ``--html``).
"""

from __future__ import annotations

from neuropod.comparison.candidates import Candidate, parse_candidate
from neuropod.comparison.problem import ProblemMismatch
from neuropod.comparison.report import render_table, write_html, write_json
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
    "render_table",
    "write_html",
    "write_json",
]
