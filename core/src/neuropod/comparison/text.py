"""The terminal table of a comparison: a row per candidate, then what disagrees, then notes."""

from __future__ import annotations

from neuropod.comparison.results import FAILED, CandidateResult, Comparison


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    value = seconds * 1e3
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def error_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def render_table(comparison: Comparison, *, width: int = 100) -> str:
    cands = comparison.candidates
    sizes = sorted({t.batch_size for c in cands for t in c.throughput})
    head = ["candidate", "verdict", "backend", "device", "load", "p50", "p99"]
    head += [f"items/s @{b}" for b in sizes]
    head += ["peak RSS", "vs base"]
    rows = [head]
    for c in cands:
        tp = {t.batch_size: t for t in c.throughput}
        row = [
            c.label, c.verdict, c.backend or "-", c.device or "-", ms(c.load_s),
            ms(c.latency.p50 if c.latency else None), ms(c.latency.p99 if c.latency else None),
            *[f"{tp[b].items_per_s:.4g}" if b in tp else "-" for b in sizes],
            mib(c.memory.peak_rss), "-" if c.slowdown is None else f"{c.slowdown:.2f}x",
        ]  # fmt: skip
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"Inputs: {comparison.inputs['source']} ({comparison.inputs['sets']} set"
                 f"{'' if comparison.inputs['sets'] == 1 else 's'}); tolerance rtol={comparison.settings['rtol']:g} "
                 f"atol={comparison.settings['atol']:g}")  # fmt: skip
    for c in cands:
        lines.extend(_details(c))
    if comparison.settings.get("rate"):
        for c in cands:
            if c.server is not None:
                lines.append(f"{c.label}: at {c.server.rate:g} calls/s (reached {c.server.achieved_rate:.3g}): "
                             f"p50 {ms(c.server.p50)}, p90 {ms(c.server.p90)}, p99 {ms(c.server.p99)}")  # fmt: skip
    for note in comparison.problem_notes:
        lines.append(f"note: {note}")
    for c in comparison.slow:
        lines.append(f"SLOW: {c.label} is {c.slowdown:.2f}x the baseline's p50 latency "
                     f"(--max-slowdown {comparison.settings['max_slowdown']:g})")  # fmt: skip
    lines.append("PASSED: every candidate agrees with the baseline" if comparison.passed else "FAILED")
    return "\n".join(lines)


def _details(c: CandidateResult) -> list[str]:
    out = []
    if c.status == FAILED:
        out.append(f"{c.label}: FAILED at {c.stage}: {c.error}")
    for o in c.outputs:
        if o.agrees:
            continue
        if o.problem:
            out.append(f"{c.label}: output {o.name!r} disagrees: {o.problem}")
            continue
        out.append(f"{c.label}: output {o.name!r} disagrees in {o.outside} of {o.elements} elements "
                   f"({o.share_outside:.1%}); max abs error {error_text(o.max_abs_error)}, max rel error "
                   f"{error_text(o.max_rel_error)}")  # fmt: skip
        for w in o.worst[:3]:
            at = f"[{', '.join(map(str, w.index))}]"
            out.append(f"    set {w.input_set + 1} {o.name}{at}: {w.value!r}, baseline {w.baseline!r}")
    for note in c.notes:
        out.append(f"{c.label}: {note}")
    return out
