"""The report's charts, as SVG drawn here: latency distributions (one call at a time, and at a target
rate), throughput per batch size, and memory. Each function returns one ``<svg>`` element, or None when
the comparison has no figure for it (the page then says why)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from neuropod.comparison.results import CandidateResult, Comparison, Latency
from neuropod.comparison.svg import (
    BLUE,
    GREY,
    INK,
    MUTED,
    RED,
    Axis,
    Canvas,
    clip,
    colour,
    footer,
    frame,
    nice_high,
    text_width,
    wrap,
    x_axis,
    y_axis,
)
from neuropod.comparison.units import compact, count, duration, size, time_unit

WIDTH = 960
LABEL_CHARS = 26
FOOTER_CHARS = 150


def chart_footer(comparison: Comparison) -> list[str]:
    """The command, versions, date and machine behind the figures, as the documentation's charts show them."""
    m = comparison.machine
    frameworks = sorted({c.framework for c in comparison.candidates if c.framework})
    lines = wrap(f"$ {comparison.command}", FOOTER_CHARS)
    if len(lines) > 3:
        lines = [*lines[:2], clip(lines[2], FOOTER_CHARS - 4) + " ..."]
    versions = ", ".join([f"neuropod {comparison.neuropod_version}", *frameworks])
    lines.append(clip(f"({versions}; {comparison.date})", FOOTER_CHARS))
    gpus = ", ".join(str(g.get("name", "GPU")) for g in m.get("gpus") or [])
    where = (
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} CPUs, {m.get('os', '?')}, Python {m.get('python', '?')}"
    )
    lines.append(clip(where + (f"; GPUs: {gpus}" if gpus else ""), FOOTER_CHARS))
    return lines


def _label(c: Canvas, x: float, y: float, i: int, cand: CandidateResult) -> None:
    """A candidate's colour swatch and label, right-aligned to ``x``, centred on ``y``."""
    c.rect(x - 10, y - 5, 10, 10, colour(i) if cand.ok else RED)
    c.text(x - 16, y + 4, clip(cand.label, LABEL_CHARS), px=12, anchor="end", tip=cand.label)


def _title(c: Canvas, title: str, subtitle: str) -> None:
    c.text(WIDTH / 2, 22, title, px=15, anchor="middle")
    if subtitle:
        c.text(WIDTH / 2, 40, subtitle, px=11, anchor="middle", fill=MUTED)


def _bands(c: Canvas, left: float, right: float, top: float, row_h: float, rows: int) -> None:
    """Every other row shaded, so a row's figures read across to its label."""
    for k in range(1, rows, 2):
        c.rect(left, top + row_h * k, right - left, row_h, "#f6f8fa")


def _missing(cand: CandidateResult) -> str:
    return f"failed at {cand.stage or 'run'}: no figures" if not cand.ok else "not measured"


# --- latency distributions -------------------------------------------------------------------------------


def _quantile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``samples`` (linear between neighbours)."""
    at = q * (len(samples) - 1)
    low = int(at)
    high = min(low + 1, len(samples) - 1)
    return samples[low] + (samples[high] - samples[low]) * (at - low)


def latency_chart(comparison: Comparison) -> str | None:
    """Each candidate's latency one call at a time (SingleStream): where its calls fell, p50/p90/p99."""
    if not any(c.latency for c in comparison.candidates):
        return None
    return _distribution(
        comparison, lambda c: c.latency, "Latency, one call at a time",
        "each call starts when the one before it returns (MLPerf's SingleStream); lower is better",
        lambda lat: f"{count(lat.count)} calls; max {duration(lat.max)}",
    )  # fmt: skip


def rate_chart(comparison: Comparison) -> str | None:
    """Each candidate's latency with calls arriving at the ``--rate`` (Server scenario)."""
    rate = comparison.settings.get("rate")
    if not rate or not any(c.server for c in comparison.candidates):
        return None

    def reached(lat: Latency) -> str:
        got = f"reached {lat.achieved_rate:.3g}/s" if lat.achieved_rate is not None else "rate not reported"
        return f"{got}; {count(lat.count)} calls; max {duration(lat.max)}"

    return _distribution(
        comparison, lambda c: c.server, f"Latency at {rate:g} calls per second",
        "Poisson arrivals; each call's time counts from when it was due, so waiting for a free slot counts",
        reached,
    )  # fmt: skip


def _distribution(comparison: Comparison, pick: Callable[[CandidateResult], Latency | None], title: str,
                  subtitle: str, second: Callable[[Latency], str]) -> str:  # fmt: skip
    cands = comparison.candidates
    rows: list[tuple[int, CandidateResult, Latency | None]] = [(i, c, pick(c)) for i, c in enumerate(cands)]
    lats = [lat for _, _, lat in rows if lat is not None]
    lows = [_quantile(lat.samples, 0.01) if lat.samples else lat.min for lat in lats]
    highs = [max(lat.p99, _quantile(lat.samples, 0.99)) if lat.samples else lat.p99 for lat in lats]
    low, high = min(v for v in lows if v > 0) if any(v > 0 for v in lows) else 0.0, max(highs)
    scale, unit = time_unit([high])
    log = low > 0 and high / low > 10
    feet = chart_footer(comparison)
    row_h, top, left, right = 46.0, 56.0, 200.0, WIDTH - 250.0
    bottom = top + row_h * len(rows)
    height = bottom + 80 + 11 * len(feet) + 8
    c = Canvas(WIDTH, height, title)
    _title(c, title, subtitle)
    if log:
        axis = Axis(low / scale / 1.25, high / scale * 1.25, left, right, log=True)
    else:
        axis = Axis(0.0, nice_high(high / scale * 1.05), left, right)
    _bands(c, left, right, top, row_h, len(rows))
    x_axis(c, axis, top, bottom, f"latency per call, {unit}" + (" (log scale)" if log else ""))
    for k, (i, cand, lat) in enumerate(rows):
        y = top + row_h * (k + 0.5)
        _label(c, left - 10, y, i, cand)
        if lat is None:
            c.text(left + 12, y + 4, _missing(cand), px=12, fill=RED if not cand.ok else MUTED)
            continue
        _one_distribution(c, axis, scale, lat, y, colour(i))
        c.text(right + 10, y - 3, f"p50 {duration(lat.p50)}   p99 {duration(lat.p99)}", px=12)
        c.text(right + 10, y + 12, clip(second(lat), 40), px=10.5, fill=MUTED)
    frame(c, left, top, right, bottom)
    _distribution_key(c, bottom + 58)
    footer(c, feet, height)
    return c.render()


def _one_distribution(c: Canvas, axis: Axis, scale: float, lat: Latency, y: float, fill: str) -> None:
    """Where one candidate's calls fell (a shaded density of its samples), its middle half as a box, p50
    as a line, p90 as a diamond, p1 to p99 as whiskers."""
    s = lat.samples
    q01, q25, q75 = (_quantile(s, 0.01), _quantile(s, 0.25), _quantile(s, 0.75)) if s else (lat.min, lat.p50, lat.p50)
    if s:
        bins = min(60, max(12, len(s) // 4))  # a few samples: wide bins, else the shade is a row of spikes
        counts = [0] * bins
        for v in s:
            if v / scale <= axis.high:
                counts[min(bins - 1, int((axis(v / scale) - axis.start) / (axis.end - axis.start) * bins))] += 1
        smooth = [(counts[max(0, b - 1)] + 2 * counts[b] + counts[min(bins - 1, b + 1)]) / 4 for b in range(bins)]
        most = max(smooth) or 1.0
        used = [b for b in range(bins) if smooth[b] > 0]
        if used:
            step = (axis.end - axis.start) / bins
            xs = [axis.start + step * (b + 0.5) for b in range(used[0], used[-1] + 1)]
            half = [16 * smooth[b] / most for b in range(used[0], used[-1] + 1)]
            points = [(x, y - h) for x, h in zip(xs, half)] + [(x, y + h) for x, h in zip(reversed(xs), reversed(half))]
            c.path(points, fill, opacity=0.22)
    x01, x25, x50, x75 = (axis(v / scale) for v in (q01, q25, lat.p50, q75))
    x90, x99 = axis(lat.p90 / scale), axis(lat.p99 / scale)
    c.line(x01, y, x25, y, INK, 1)
    c.line(x75, y, x99, y, INK, 1)
    c.line(x01, y - 5, x01, y + 5, INK, 1)
    c.line(x99, y - 5, x99, y + 5, INK, 1)
    c.rect(x25, y - 7, max(x75 - x25, 1.5), 14, fill, stroke=INK,
           tip=f"p25 {duration(q25)}, p50 {duration(lat.p50)}, p75 {duration(q75)}")  # fmt: skip
    c.line(x50, y - 7, x50, y + 7, "#ffffff", 2.2)
    c.line(x50, y - 7, x50, y + 7, INK, 0.8)
    c.diamond(x90, y, 4, "#ffffff", tip=f"p90 {duration(lat.p90)}")


def _distribution_key(c: Canvas, y: float) -> None:
    x = 200.0
    c.path([(x, y - 6), (x + 20, y - 2), (x + 40, y - 5), (x + 40, y + 5), (x + 20, y + 2), (x, y + 6)], BLUE,
           opacity=0.22)  # fmt: skip
    c.line(x, y, x + 10, y, INK, 1)
    c.rect(x + 10, y - 5, 16, 10, BLUE, stroke=INK)
    c.line(x + 17, y - 5, x + 17, y + 5, "#ffffff", 2)
    c.line(x + 26, y, x + 40, y, INK, 1)
    c.diamond(x + 33, y, 3.5, "#ffffff")
    c.text(x + 48, y + 4, "shade: where the calls fell;  box: middle half (p25 to p75);  white line: p50 (median);  "
           "diamond: p90;  whiskers: p1 to p99", px=10.5, fill=MUTED)  # fmt: skip


# --- throughput --------------------------------------------------------------------------------------------


def throughput_chart(comparison: Comparison) -> str | None:
    """Items per second at each batch size: a panel per batch size, a bar per candidate, each panel's
    axis from zero (sizes differ by orders of magnitude, candidates at one size are what compares)."""
    cands = comparison.candidates
    sizes = sorted({t.batch_size for cand in cands for t in cand.throughput})
    if not sizes:
        return None
    feet = chart_footer(comparison)
    legend = _legend_rows(cands)
    top, plot_h, left, gap = 56.0, 230.0, 76.0, 56.0
    pw = (WIDTH - left - 16 - gap * (len(sizes) - 1)) / len(sizes)
    bottom = top + plot_h
    height = bottom + 40 + 20 * len(legend) + 24 + 11 * len(feet) + 8
    title = "Throughput by batch size"
    c = Canvas(WIDTH, height, title)
    _title(
        c, title, "calls of one batch back to back (MLPerf's Offline); items are rows of the batch; higher is better"
    )
    c.text(18, top + plot_h / 2, "items per second", px=12, anchor="middle", rotate=True)
    slot = (pw - 12) / len(cands)
    bar = min(56.0, slot * 0.8)
    for p, b in enumerate(sizes):
        x0 = left + p * (pw + gap)
        values = {i: next((t for t in cand.throughput if t.batch_size == b), None) for i, cand in enumerate(cands)}
        most = max((t.items_per_s for t in values.values() if t is not None), default=0.0)
        axis = Axis(0.0, nice_high(most * 1.08) if most > 0 else 1.0, bottom, top)
        y_axis(c, axis, x0, x0 + pw, fmt=compact)
        for i, cand in enumerate(cands):
            cx = x0 + 6 + slot * (i + 0.5)
            t = values[i]
            if t is None:
                c.text(cx, bottom - 4, "×" if not cand.ok else "–", px=12, anchor="middle",
                       fill=RED if not cand.ok else MUTED, tip=f"{cand.label}: {_missing(cand)}")  # fmt: skip
                continue
            y = axis(t.items_per_s)
            c.rect(cx - bar / 2, y, bar, bottom - y, colour(i),
                   tip=f"{cand.label}: {count(t.items_per_s)} items/s at batch {b} ({count(t.calls)} calls in "
                       f"{t.seconds:.2g} s; p50 {duration(t.p50)} per call)")  # fmt: skip
            if slot >= 30:
                c.text(cx, y - 4, compact(t.items_per_s), px=10, anchor="middle")
        frame(c, x0, top, x0 + pw, bottom)
        c.text(x0 + pw / 2, bottom + 18, f"batch {b}", px=12, anchor="middle", bold=True)
    _legend(c, cands, legend, bottom + 44)
    if any(len(cand.throughput) < len(sizes) for cand in cands):
        c.text(76, bottom + 44 + 20 * len(legend), "×: the candidate failed;  –: no figure at this batch size", px=10.5,
               fill=MUTED)  # fmt: skip
    footer(c, feet, height)
    return c.render()


def _legend_rows(cands: Sequence[CandidateResult]) -> list[list[tuple[int, str, float]]]:
    """The legend's entries (candidate index, text, width), in rows that fit the chart's width."""
    rows: list[list[tuple[int, str, float]]] = [[]]
    used = 0.0
    for i, cand in enumerate(cands):
        text = clip(cand.label, LABEL_CHARS) + ("" if cand.ok else " (failed)")
        w = 16 + text_width(text, 11) + 22
        if rows[-1] and used + w > WIDTH - 80:
            rows.append([])
            used = 0.0
        rows[-1].append((i, text, w))
        used += w
    return rows


def _legend(c: Canvas, cands: Sequence[CandidateResult], rows: list[list[tuple[int, str, float]]], y: float) -> None:
    for r, row in enumerate(rows):
        x = 76.0
        for i, text, w in row:
            c.rect(x, y + r * 20 - 9, 11, 11, colour(i) if cands[i].ok else RED)
            c.text(x + 16, y + r * 20 + 1, text, px=11)
            x += w


# --- memory ------------------------------------------------------------------------------------------------


def _size_unit(most: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if most >= scale * 2:
            return float(scale), name
    return 1.0, "bytes"


def memory_chart(comparison: Comparison) -> str | None:
    """Peak resident memory of each candidate's processes (before loading, and what loading and running
    added), and GPU memory where NVML measured some."""
    cands = comparison.candidates
    peaks = [cand.memory.peak_rss for cand in cands if cand.memory.peak_rss]
    gpus = [cand.memory.gpu_bytes for cand in cands if cand.memory.gpu_bytes]
    if not peaks and not gpus:
        return None
    feet = chart_footer(comparison)
    row_h, top, left = 40.0, 56.0, 200.0
    split = WIDTH - 260.0 if gpus else WIDTH - 24.0
    bottom = top + row_h * len(cands)
    height = bottom + 80 + 11 * len(feet) + 8
    title = "Peak memory"
    c = Canvas(WIDTH, height, title)
    _title(c, title, "resident memory (RSS) of the candidate's process and its workers at their peak; lower is better")
    scale, unit = _size_unit(max(peaks, default=0))
    rss = Axis(0.0, nice_high(max(peaks, default=1) / scale * 1.55), left, split)
    if gpus:
        g_scale, g_unit = _size_unit(max(gpus))
        gpu = Axis(0.0, nice_high(max(gpus) / g_scale * 1.55), split + 40, WIDTH - 24)
    _bands(c, left, split, top, row_h, len(cands))
    x_axis(c, rss, top, bottom, f"peak RSS, {unit}")
    if gpus:
        _bands(c, gpu.start, gpu.end, top, row_h, len(cands))
        x_axis(c, gpu, top, bottom, f"GPU memory (NVML), {g_unit}")
    for k, cand in enumerate(cands):
        y = top + row_h * (k + 0.5)
        _label(c, left - 10, y, k, cand)
        m = cand.memory
        if m.peak_rss is None:
            c.text(left + 12, y + 4, "no RSS figure" if cand.ok else _missing(cand), px=12,
                   fill=MUTED if cand.ok else RED)  # fmt: skip
        else:
            before = min(m.rss_before_load or 0, m.peak_rss)
            x0, x1, x2 = rss(0), rss(before / scale), rss(m.peak_rss / scale)
            c.rect(x0, y - 10, x1 - x0, 20, GREY, tip=f"before loading: {size(m.rss_before_load)}")
            tip = f"{cand.label}: peak {size(m.peak_rss)}; loading and running added {size(m.added_rss)}"
            c.rect(x1, y - 10, x2 - x1, 20, colour(k), tip=tip)
            added = f" (+{size(m.added_rss)})" if m.added_rss is not None else ""
            c.text(x2 + 6, y + 4, size(m.peak_rss) + added, px=11)
        if gpus:
            if m.gpu_bytes:
                x = gpu(m.gpu_bytes / g_scale)
                c.rect(gpu.start, y - 10, x - gpu.start, 20, colour(k), tip=f"{cand.label}: GPU {size(m.gpu_bytes)}")
                c.text(x + 6, y + 4, size(m.gpu_bytes), px=11)
            else:
                c.text(gpu.start + 6, y + 4, "none" if cand.ok else "-", px=11, fill=MUTED)
    frame(c, left, top, split, bottom)
    if gpus:
        frame(c, gpu.start, top, gpu.end, bottom)
    c.rect(left, bottom + 50, 11, 11, GREY)
    c.text(left + 16, bottom + 60, "the process before loading (Python, neuropod, numpy)", px=10.5, fill=MUTED)
    c.rect(left + 330, bottom + 50, 11, 11, BLUE)
    c.text(left + 346, bottom + 60, "added by loading and running the model", px=10.5,
           fill=MUTED)  # fmt: skip
    footer(c, feet, height)
    return c.render()
