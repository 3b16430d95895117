"""The self-contained HTML report of a comparison (placeholder until the full report lands)."""

from __future__ import annotations

import html

from neuropod.comparison.results import Comparison


def render_html(comparison: Comparison) -> str:
    return f"<!doctype html><meta charset=utf-8><title>neuropod compare</title><pre>{html.escape(comparison.table())}</pre>"
