"""A comparison written out: the terminal table, the JSON file and the HTML page."""

from __future__ import annotations

import os
from pathlib import Path

from neuropod.comparison.html import render_html
from neuropod.comparison.results import Comparison
from neuropod.comparison.text import render_table


def write_html(comparison: Comparison, path: str | os.PathLike[str]) -> Path:
    """Write the self-contained HTML report (no network needed to view it) to ``path``."""
    target = Path(path)
    target.write_text(render_html(comparison), encoding="utf-8")
    return target


def write_json(comparison: Comparison, path: str | os.PathLike[str]) -> Path:
    """Write every figure, the machine, the versions, the command and the date as JSON to ``path``."""
    target = Path(path)
    target.write_text(comparison.to_json() + "\n", encoding="utf-8")
    return target


__all__ = ["render_html", "render_table", "write_html", "write_json"]
