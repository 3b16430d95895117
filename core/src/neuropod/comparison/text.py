"""The terminal table of a comparison: a row per candidate, then what disagrees or failed, then notes and
the verdict. Fits ~100 columns: long labels and backend names are cut (``…``) when the row would not."""

from __future__ import annotations

from neuropod.comparison.results import AGREES, BASELINE, CandidateResult, Comparison
from neuropod.comparison.units import compact, count, duration, element, error, number, plural, share, time_unit, times

#: Columns cut first when a row is too wide (candidate, backend), and the narrowest each may become.
_SHRINK = {0: 12, 2: 10}


def render_table(comparison: Comparison, *, width: int = 100) -> str:
    """The table and its notes; the table fits ``width`` columns where cutting labels can make it."""
    cands = comparison.candidates
    sizes = sorted({t.batch_size for c in cands for t in c.throughput})
    lat_scale, lat_unit = time_unit([v for c in cands if c.latency for v in (c.latency.p50, c.latency.p99)])
    load_scale, load_unit = time_unit([c.load_s for c in cands])
    mem_scale, mem_unit = _memory_unit([c.memory.peak_rss for c in cands])
    places = {(c.device or "-") + (" ope" if c.use_ope else "") for c in cands}
    one_place = len(places) == 1 and len(cands) > 1
    # Two header lines: a column's name, then its unit (numbers line up without a unit in every cell).
    head: list[tuple[str, str]] = [("candidate", ""), ("verdict", ""), ("backend", "")]
    head += [] if one_place else [("device", "")]
    timed = any(c.latency for c in cands)
    head += [("load", load_unit)] + ([("p50", lat_unit), ("p99", lat_unit)] if timed else [])
    head += [("items/s" if k == 0 else "", f"@{b}") for k, b in enumerate(sizes)]
    head += [("peak RSS", mem_unit)] + ([("vs", "base")] if timed else [])
    text_columns = 3 if one_place else 4
    rows = []
    for i, c in enumerate(cands):
        tp = {t.batch_size: t for t in c.throughput}
        lat = c.latency
        row = [c.label, c.verdict + (" SLOW" if c in comparison.slow else ""), c.backend or "-"]
        row += [] if one_place else [(c.device or "-") + (" ope" if c.use_ope else "")]
        row += [_in(c.load_s, load_scale)]
        row += [_in(lat.p50 if lat else None, lat_scale), _in(lat.p99 if lat else None, lat_scale)] if timed else []
        row += [compact(tp[b].items_per_s) if b in tp else "-" for b in sizes] + [_in(c.memory.peak_rss, mem_scale)]
        row += ["base" if i == 0 and lat else times(c.slowdown)] if timed else []
        rows.append([" ".join(cell.split()) for cell in row])  # one line per row, whatever a label holds
    widths = [max(len(h[0]), len(h[1]), *(len(r[k]) for r in rows)) for k, h in enumerate(head)]
    widths = _fit(widths, width - (len(widths) - 1) - text_columns)
    lines = [_line([h[0] for h in head], widths, text_columns), _line([h[1] for h in head], widths, text_columns)]
    lines.append(_line(["-" * w for w in widths], widths, text_columns))
    lines += [_line(r, widths, text_columns) for r in rows]
    lines.append("")
    inputs, s = comparison.inputs, comparison.settings
    lines.append(f"Inputs: {inputs.get('source', '?')} ({plural(int(inputs.get('sets', 0)), 'set')}); tolerance "
                 f"rtol={s.get('rtol', 0):g} atol={s.get('atol', 0):g}"
                 + (f"; every candidate on {places.pop()}" if one_place else ""))  # fmt: skip
    if not s.get("speed", True):
        lines.append("Speed: not measured (--no-speed)")
    for c in cands:
        lines.extend(_details(c))
    if s.get("rate"):
        for c in cands:
            if c.server is not None:
                reached = f" (reached {c.server.achieved_rate:.3g})" if c.server.achieved_rate is not None else ""
                lines.append(f"{c.label}: at {s['rate']:g} calls/s{reached}: p50 {duration(c.server.p50)}, "
                             f"p90 {duration(c.server.p90)}, p99 {duration(c.server.p99)}")  # fmt: skip
    for note in comparison.problem_notes:
        lines.append(f"note: {note}")
    for c in comparison.slow:
        lines.append(f"SLOW: {c.label} is {times(c.slowdown)} the baseline's p50 latency "
                     f"(--max-slowdown {s['max_slowdown']:g})")  # fmt: skip
    if comparison.passed:
        lines.append("PASSED: every candidate agrees with the baseline" if len(cands) > 1 else
                     "PASSED: only the baseline ran, nothing to compare it with")  # fmt: skip
    else:
        bad = [c for c in cands if c.verdict not in (BASELINE, AGREES)] + comparison.slow
        lines.append(f"FAILED: {', '.join(dict.fromkeys(c.label for c in bad)) or 'see above'}")
    return "\n".join(lines)


def _in(value: float | None, scale: float) -> str:
    return "-" if value is None else number(value / scale)


def _memory_unit(values: list[int | None]) -> tuple[float, str]:
    known = [v for v in values if v]
    most = max(known, default=0)
    return (2.0**30, "GiB") if most >= 10 * 2**30 else (2.0**20, "MiB") if most >= 2**20 else (2.0**10, "KiB")


def _fit(widths: list[int], width: int) -> list[int]:
    """Column widths cut (the candidate's first, then the backend's) until they add up to at most ``width``."""
    widths = list(widths)
    for k, least in _SHRINK.items():
        over = sum(widths) - width
        if over <= 0:
            break
        widths[k] = max(least, widths[k] - over)
    return widths


def _line(row: list[str], widths: list[int], text_columns: int) -> str:
    """One row: text columns left-aligned two spaces apart, numbers right-aligned one space apart."""
    out = ""
    for k, (cell, w) in enumerate(zip(row, widths)):
        cell = cell if len(cell) <= w else cell[: w - 1] + "…"
        out += ("" if k == 0 else "  " if k <= text_columns else " ") + (
            cell.ljust(w) if k < text_columns else cell.rjust(w)
        )
    return out.rstrip()


def _details(c: CandidateResult) -> list[str]:
    out = []
    if not c.ok:
        message = "\n    ".join((c.error or "").strip().splitlines()) or "no error message"
        out.append(f"{c.label}: FAILED at {c.stage or 'run'}: {message}")
    for o in c.outputs:
        if o.agrees:
            continue
        if o.problem:
            out.append(f"{c.label}: output {o.name!r} disagrees: {o.problem}")
            continue
        line = f"{c.label}: output {o.name!r} disagrees in {count(o.outside)} of {count(o.elements)} elements " \
               f"({share(o.share_outside)})"  # fmt: skip
        if not o.exact:
            line += f"; max abs error {error(o.max_abs_error, infinite=True)}, max rel error " \
                    f"{error(o.max_rel_error, infinite=True)}"  # fmt: skip
        out.append(line)
        for w in o.worst[:3]:
            at = f"[{', '.join(map(str, w.index))}]"
            out.append(f"    set {w.input_set + 1} {o.name}{at}: {element(w.value, o.dtype)}, "
                       f"baseline {element(w.baseline, o.dtype)}")  # fmt: skip
    for note in c.notes:
        out.append(f"{c.label}: {note}")
    if c.remote and c.memory.note:  # the peak RSS column is the client's, not the served model's
        out.append(f"{c.label}: memory: {c.memory.note}")
    return out
