"""Figures of a comparison as people read them: times, sizes, rates, errors and shares with their units.

Shared by the terminal table, the HTML report and its charts, so that one figure reads the same in all three.
A column of times uses one unit for every row (:func:`time_unit`) so that digits line up and compare.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

#: (seconds per unit, name), smallest first.
TIME_UNITS = ((1e-9, "ns"), (1e-6, "µs"), (1e-3, "ms"), (1.0, "s"))


def time_unit(values: Iterable[float | None]) -> tuple[float, str]:
    """The unit in which the smallest of ``values`` (seconds) is at least 1: ``(1e-6, "µs")`` for 4.3e-6."""
    known = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not known:
        return 1e-3, "ms"
    low = min(known)
    for scale, name in reversed(TIME_UNITS):
        if low >= scale:
            return scale, name
    return TIME_UNITS[0]


def number(value: float) -> str:
    """Three significant digits, whole numbers with thousands separators: ``4.32``, ``43.2``, ``4,316``."""
    if value == 0:
        return "0"
    size = abs(value)
    if size >= 99.95:
        return f"{value:,.0f}"
    if size >= 9.995:
        return f"{value:.1f}"
    if size >= 0.9995:
        return f"{value:.2f}"
    return f"{value:.3g}"


def duration(seconds: float | None, unit: tuple[float, str] | None = None) -> str:
    """``seconds`` in ``unit`` (by default the value's own): ``4.32 µs``, ``1,234 µs``; ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    scale, name = unit or time_unit([seconds])
    return f"{number(seconds / scale)} {name}"


def size(n: int | float | None) -> str:
    """Bytes in binary units: ``2.0 KiB``, ``75.9 MiB``, ``1.25 GiB``; ``-`` for None."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n:.0f} B"
    value = float(n)
    for name in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{number(value)} {name}"
    return f"{number(value / 1024)} TiB"


def compact(value: float | None) -> str:
    """A count in three significant digits with k/M/G: ``213k``, ``1.71M``, ``950``; ``-`` for None."""
    if value is None or not math.isfinite(value):
        return "-"
    for scale, name in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale * 0.9995:
            return f"{value / scale:.3g}{name}"
    return f"{value:.3g}"


def count(value: float | None) -> str:
    """A count or rate in full, with thousands separators: ``213,457``; ``-`` for None."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def error(value: float | None, *, infinite: bool = False) -> str:
    """An absolute or relative error: ``0``, ``1.2e-07``, ``0.031``. None is ``-``, or ``inf/NaN`` when
    ``infinite`` (the comparison keeps an infinite or NaN error as None: JSON has neither)."""
    if value is None:
        return "inf/NaN" if infinite else "-"
    if value == 0:
        return "0"
    return f"{value:.2g}"


def share(value: float) -> str:
    """A share as a percentage: ``0%``, ``75%``, ``0.013%``."""
    return "0%" if value == 0 else f"{100 * value:.2g}%" if value < 0.01 else f"{100 * value:.3g}%"


def times(value: float | None, sign: str = "x") -> str:
    """A ratio such as a slowdown: ``4.16x``, ``12.5x``, ``486x`` (``sign`` ``×`` on a page); ``-`` for None."""
    if value is None:
        return "-"
    return f"{value:.0f}{sign}" if value >= 99.5 else f"{value:.1f}{sign}" if value >= 9.995 else f"{value:.2f}{sign}"


def element(value: object, dtype: str = "", limit: int = 60) -> str:
    """One tensor element of an output of ``dtype`` for a reader: strings quoted, float32 in the 9 digits
    that tell two float32s apart, float64 in full, anything cut at ``limit`` characters."""
    if dtype == "string" and isinstance(value, str):
        text = repr(value)
    elif isinstance(value, float):
        text = f"{value:.9g}" if dtype in ("float32", "float16", "bfloat16") else repr(value)
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
