"""A small SVG canvas and axes for the report's charts: no plotting library, text escaped, no external reference.

The look follows the documentation's charts (``bench/charts.py``, drawn by matplotlib): white ground, a
black frame with outward ticks, DejaVu Sans, the same blues, greys and red, and a monospace footer
naming the command, the machine and the date.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Sequence

#: The documentation charts' colours: our bars, the framework alone (here: what is not the candidate's
#: own, e.g. memory before loading) and a miss (a failed candidate).
BLUE, GREY, RED = "#2f6db5", "#a9b4c2", "#c0392b"
INK, MUTED, FAINT = "#222222", "#444444", "#e6e9ee"
FONT = "'DejaVu Sans', Verdana, 'Segoe UI', Arial, sans-serif"
MONO = "'DejaVu Sans Mono', Menlo, Consolas, monospace"
#: A colour per candidate, in order: the docs' blue and orange, then colours that stay apart in print
#: and for the common colour blindnesses (no red: red means failed).
PALETTE = ("#2f6db5", "#e08a3c", "#8e6bbf", "#3a9a5b", "#6f9fd8", "#c9a227", "#8c564b", "#d16ba5", "#5f6b7a",
           "#17becf")  # fmt: skip

# Characters XML does not allow (control characters but tab and newline), and lone surrogates.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def esc(value: object) -> str:
    """``value`` as text in HTML or SVG: markup escaped (quotes too), control characters shown as ``\\xNN``."""
    text = _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else "\ufffd", str(value))
    return html.escape(text, quote=True)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[: max(1, limit - 1)] + "…"


def text_width(text: str, px: float) -> float:
    """About how wide ``text`` is in DejaVu Sans at ``px`` (the average glyph is ~0.6 of the size)."""
    return len(text) * px * 0.6


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _n(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Canvas:
    """An SVG drawing of a fixed size, built shape by shape; :meth:`render` gives the ``<svg>`` element."""

    def __init__(self, width: float, height: float, title: str) -> None:
        self.width, self.height, self.title = width, height, title
        self.parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, *, stroke: str | None = None,
             opacity: float | None = None, tip: str | None = None) -> None:  # fmt: skip
        extra = f' stroke="{stroke}" stroke-width="0.8"' if stroke else ""
        extra += f' fill-opacity="{opacity}"' if opacity is not None else ""
        shape = f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(max(w, 0))}" height="{_n(max(h, 0))}" fill="{fill}"{extra}'
        self.parts.append(shape + (f"><title>{esc(tip)}</title></rect>" if tip else "/>"))

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = INK, width: float = 0.8, *,
             dash: str | None = None) -> None:  # fmt: skip
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" stroke="{stroke}" '
                          f'stroke-width="{width}"{extra}/>')  # fmt: skip

    def path(self, points: Sequence[tuple[float, float]], fill: str, *, stroke: str | None = None,
             opacity: float = 1.0) -> None:  # fmt: skip
        d = "M" + " L".join(f"{_n(x)} {_n(y)}" for x, y in points) + " Z"
        line = f' stroke="{stroke}" stroke-width="0.8"' if stroke else ""
        self.parts.append(f'<path d="{d}" fill="{fill}" fill-opacity="{opacity}"{line}/>')

    def diamond(self, x: float, y: float, r: float, fill: str, tip: str | None = None) -> None:
        d = f"M{_n(x)} {_n(y - r)} L{_n(x + r)} {_n(y)} L{_n(x)} {_n(y + r)} L{_n(x - r)} {_n(y)} Z"
        shape = f'<path d="{d}" fill="{fill}" stroke="{INK}" stroke-width="0.6"'
        self.parts.append(shape + (f"><title>{esc(tip)}</title></path>" if tip else "/>"))

    def text(self, x: float, y: float, text: str, *, px: float = 12, anchor: str = "start", fill: str = INK,
             bold: bool = False, mono: bool = False, rotate: bool = False, tip: str | None = None) -> None:  # fmt: skip
        """One line of text; ``y`` is its baseline."""
        attrs = f'x="{_n(x)}" y="{_n(y)}" font-size="{_n(px)}"'
        if anchor != "start":
            attrs += f' text-anchor="{anchor}"'
        if fill != INK:
            attrs += f' fill="{fill}"'
        if bold:
            attrs += ' font-weight="bold"'
        if mono:
            attrs += f' font-family="{MONO}"'
        if rotate:
            attrs += f' transform="rotate(-90 {_n(x)} {_n(y)})"'
        inner = esc(text) + (f"<title>{esc(tip)}</title>" if tip else "")
        self.parts.append(f"<text {attrs}>{inner}</text>")

    def render(self) -> str:
        w, h = _n(self.width), _n(self.height)
        return (f'<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" font-family="{FONT}" '
                f'fill="{INK}"><title>{esc(self.title)}</title><rect width="{w}" height="{h}" fill="#ffffff"/>'
                + "".join(self.parts) + "</svg>")  # fmt: skip


class Axis:
    """Values to positions between ``start`` and ``end`` pixels, linear or logarithmic, with nice ticks."""

    def __init__(self, low: float, high: float, start: float, end: float, *, log: bool = False) -> None:
        if log:
            low = max(low, 1e-300)
            high = max(high, low * 1.0001)
        elif high <= low:
            high = low + (abs(low) or 1.0)
        self.low, self.high, self.start, self.end, self.log = low, high, start, end, log

    def __call__(self, value: float) -> float:
        """The position of ``value``, held to the axis's ends."""
        if self.log:
            value = max(value, self.low)
            share = math.log(value / self.low) / math.log(self.high / self.low)
        else:
            share = (value - self.low) / (self.high - self.low)
        return self.start + (self.end - self.start) * min(max(share, 0.0), 1.0)

    def ticks(self, most: int = 7) -> list[float]:
        if not self.log:
            return linear_ticks(self.low, self.high, most)
        first, last = math.floor(math.log10(self.low)), math.ceil(math.log10(self.high))
        steps = (1, 2, 5) if last - first <= 3 else (1,)
        found = [m * 10.0**e for e in range(first, last + 1) for m in steps]
        return [v for v in found if self.low * 0.999 <= v <= self.high * 1.001]


def linear_ticks(low: float, high: float, most: int = 7) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) from ``low`` to ``high``, at most ``most``."""
    span = high - low
    if span <= 0:
        return [low]
    raw = span / max(1, most - 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    count = math.floor((high - first) / step + 1e-9) + 1
    return [round(first + i * step, 12) for i in range(count)]


def nice_high(value: float) -> float:
    """The round number at or above ``value`` an axis ends on (1, 2, 2.5, 5 times a power of ten)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * power >= value * 0.9999)


def tick_label(value: float) -> str:
    """A tick's number: ``0``, ``2.5``, ``40``, ``1,000``, ``0.002``."""
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.6g}"


def frame(c: Canvas, left: float, top: float, right: float, bottom: float) -> None:
    """The plot area's black frame, as matplotlib draws it."""
    c.parts.append(f'<rect x="{_n(left)}" y="{_n(top)}" width="{_n(right - left)}" height="{_n(bottom - top)}" '
                   f'fill="none" stroke="{INK}" stroke-width="0.8"/>')  # fmt: skip


def x_axis(c: Canvas, axis: Axis, top: float, bottom: float, label: str, *,
           fmt: Callable[[float], str] = tick_label) -> None:  # fmt: skip
    """Grid lines, outward ticks and numbers under a horizontal axis, and its label."""
    for v in axis.ticks():
        x = axis(v)
        c.line(x, top, x, bottom, FAINT, 1)
        c.line(x, bottom, x, bottom + 3.5)
        c.text(x, bottom + 16, fmt(v), px=11, anchor="middle")
    c.text((axis.start + axis.end) / 2, bottom + 33, label, px=12, anchor="middle")


def y_axis(c: Canvas, axis: Axis, left: float, right: float, *, fmt: Callable[[float], str] = tick_label) -> None:
    """Grid lines, outward ticks and numbers left of a vertical axis."""
    for v in axis.ticks(6):
        y = axis(v)
        c.line(left, y, right, y, FAINT, 1)
        c.line(left - 3.5, y, left, y)
        c.text(left - 6, y + 4, fmt(v), px=11, anchor="end")


def footer(c: Canvas, lines: Sequence[str], bottom: float) -> None:
    """The chart's monospace footer lines, the last ending ``bottom`` pixels down."""
    for i, line in enumerate(reversed(lines)):
        c.text(8, bottom - 4 - i * 11, line, px=8.7, fill=MUTED, mono=True)


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces where there are some."""
    lines: list[str] = []
    for para in text.splitlines() or [""]:
        while len(para) > width:
            cut = para.rfind(" ", 0, width)
            cut = cut if cut > width // 2 else width
            lines.append(para[:cut])
            para = para[cut:].lstrip(" ")
        lines.append(para)
    return lines
