"""The HTML report of a comparison: one self-contained page (inline CSS and SVG; no script, font, image or
stylesheet from anywhere) with the verdicts, the agreement tables, the charts and how the figures were made.

Everything that comes from a package, a server or the command line (labels, names, errors, values) is
escaped where it is written, so a label such as ``<script>`` reads as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from neuropod.comparison.charts import latency_chart, memory_chart, rate_chart, throughput_chart
from neuropod.comparison.measure import SERVER_THREADS
from neuropod.comparison.results import (
    AGREES,
    BASELINE,
    DISAGREES,
    FAILED,
    NOT_COMPARED,
    CandidateResult,
    Comparison,
    OutputAgreement,
)
from neuropod.comparison.svg import clip, colour, esc
from neuropod.comparison.units import count, duration, element, error, plural, share, size, time_unit, times

#: Verdict badges' colours (and "slow": too slow for --max-slowdown).
BADGES = {
    BASELINE: "#2f6db5", AGREES: "#2e7d32", DISAGREES: "#c0392b", FAILED: "#8e1b10", NOT_COMPARED: "#6b7280",
    "slow": "#b45309",
}  # fmt: skip

CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f4f6f9;color:#1f2328;font:14px/1.45 system-ui,-apple-system,'Segoe UI','DejaVu Sans',
 Roboto,Arial,sans-serif}
main{max-width:1240px;margin:0 auto;padding:24px 28px 40px}
h1{font-size:26px;margin:4px 0 14px;font-weight:650;overflow-wrap:anywhere}
h2{font-size:19px;margin:0 0 12px;padding-bottom:6px;border-bottom:1px solid #e3e6ea}
h3{font-size:15px;margin:18px 0 8px;overflow-wrap:anywhere}
h4{font-size:13px;margin:12px 0 6px;color:#444}
section{background:#fff;border:1px solid #e3e6ea;border-radius:8px;padding:18px 22px;margin:18px 0}
.kicker{font:600 12px/1 'DejaVu Sans Mono',Menlo,Consolas,monospace;letter-spacing:.08em;text-transform:uppercase;
 color:#5f6b7a}
.verdict{display:flex;gap:22px;align-items:center;border-radius:8px;padding:16px 22px;margin:0 0 16px;
 border:1px solid;border-left-width:10px}
.verdict .word{font-size:44px;font-weight:800;letter-spacing:.04em;line-height:1}
.verdict.pass{background:#eaf6ec;border-color:#2e7d32;color:#1b5e20}
.verdict.fail{background:#fbeceb;border-color:#c0392b;color:#8e1b10}
.verdict ul{margin:0;padding-left:18px}.verdict p{margin:0}
.why{color:#1f2328;font-size:15px}
pre,code,.mono{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:12.5px}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:0}
pre.cmd{background:#1f2430;color:#e8ecf2;border-radius:6px;padding:10px 14px;margin:0 0 14px}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:4px 18px;margin:0}
dl.facts dt{color:#5f6b7a;font-weight:600}dl.facts dd{margin:0;overflow-wrap:anywhere}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:6px 9px;border-bottom:1px solid #e8ebef;text-align:left;vertical-align:top}
th{background:#f3f5f8;font-weight:600;white-space:nowrap}
thead tr.group th{background:#fff;color:#5f6b7a;font-size:11.5px;text-transform:uppercase;letter-spacing:.05em;
 border-bottom:none;padding-bottom:0}
tbody tr:nth-child(even) td{background:#fafbfc}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.bad{color:#c0392b;font-weight:600}
.sub{display:block;color:#5f6b7a;font-size:12px;overflow-wrap:anywhere}
.label{font-weight:650;overflow-wrap:anywhere}
td.who{min-width:190px;max-width:320px}
table.wide th,table.wide td{padding:6px 7px}
table.fit{width:auto;min-width:min(100%,760px)}
th .sub{font-weight:400}
td.nw{white-space:nowrap}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;vertical-align:-1px}
.badge{display:inline-block;padding:1px 9px;border-radius:10px;color:#fff;font-size:12px;font-weight:650;
 white-space:nowrap;margin:1px 4px 1px 0}
.error{border-left:4px solid #8e1b10;background:#fbeceb;padding:10px 14px;border-radius:4px;margin:8px 0}
.error pre{max-height:24em;overflow:auto}
figure{margin:18px 0 10px;border:1px solid #e3e6ea;border-radius:6px;padding:8px;background:#fff;overflow-x:auto}
figure svg{display:block;max-width:100%;height:auto;margin:0 auto}
figure:first-of-type{margin-top:0}
.note{color:#5f6b7a;margin:6px 0}
ul.notes{margin:0;padding-left:20px}ul.notes li{margin:3px 0;overflow-wrap:anywhere}
footer{color:#5f6b7a;font-size:12.5px;margin-top:18px}
@media print{body{background:#fff}main{padding:0}section,figure{break-inside:avoid}.scroll{overflow:visible}}
"""


def render_html(comparison: Comparison) -> str:
    """The report as one HTML page."""
    c = comparison
    verdict = "PASSED" if c.passed else "FAILED"
    title = clip(f"neuropod compare: {verdict}: " + ", ".join(x.label for x in c.candidates), 200)
    body = [
        _header(c), _candidates(c), _failures(c), _agreement(c), _speed(c), _memory(c), _notes(c), _method(c),
        f"<footer><p>Written by neuropod {esc(c.neuropod_version)} on {esc(c.date)}. Times are per call; KiB, MiB "
        "and GiB are 1024-based.</p></footer>",
    ]  # fmt: skip
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><meta name="color-scheme" content="light">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body><main>\n"
        + "\n".join(part for part in body if part)
        + "\n</main></body></html>\n"
    )


def _badge(verdict: str) -> str:
    return f'<span class="badge" style="background:{BADGES.get(verdict, "#6b7280")}">{esc(verdict)}</span>'


def _swatch(i: int, cand: CandidateResult) -> str:
    return f'<span class="swatch" style="background:{colour(i) if cand.ok else "#c0392b"}"></span>'


def _table(head: str, rows: Sequence[str]) -> str:
    """A table as wide as its figures (scrolling sideways on a narrow screen)."""
    return f'<div class="scroll"><table class="fit"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table></div>'


def _td(value: str, cls: str = "") -> str:
    return f'<td class="{cls}">{value}</td>' if cls else f"<td>{value}</td>"


# --- the header: what ran, where, and the verdict -----------------------------------------------------------


def _header(c: Comparison) -> str:
    base = c.baseline
    others = len(c.candidates) - 1
    if 0 < others <= 2:
        heading = f"{esc(clip(base.label, 60))} against " + " and ".join(
            esc(clip(x.label, 60)) for x in c.candidates[1:]
        )
    else:
        heading = esc(clip(base.label, 60)) + (f" against {others} candidates" if others else ": the baseline alone")
    return (f'<header><div class="kicker">neuropod compare</div><h1>{heading}</h1>{_verdict(c)}'
            f'<pre class="cmd">$ {esc(c.command)}</pre><dl class="facts">{_facts(c)}</dl></header>')  # fmt: skip


def _verdict(c: Comparison) -> str:
    s = c.settings
    tolerance = f"rtol {s.get('rtol', '?')}, atol {s.get('atol', '?')}"
    if c.passed:
        if len(c.candidates) == 1:
            why = f"Only the baseline, {esc(c.baseline.label)}, ran: there is nothing to compare it with."
        else:
            why = (f"Every candidate agrees with the baseline, {esc(c.baseline.label)}, within {esc(tolerance)}"
                   f" (exactly for strings, integers and booleans)")  # fmt: skip
            if s.get("max_slowdown") is not None:
                why += f", and none is more than {esc(s['max_slowdown'])}× slower at p50"
            why += "."
        return f'<div class="verdict pass"><div class="word">PASSED</div><p class="why">{why}</p></div>'
    reasons = [f"<li>{r}</li>" for r in _reasons(c)]
    return f'<div class="verdict fail"><div class="word">FAILED</div><ul class="why">{"".join(reasons)}</ul></div>'


def _reasons(c: Comparison) -> list[str]:
    """Why the comparison failed: one line per candidate that disagrees, failed or is too slow."""
    out = []
    for cand in c.candidates:
        who = f"<b>{esc(cand.label)}</b>"
        if cand.verdict == FAILED:
            out.append(f"{who} failed at {esc(cand.stage or 'run')}: {esc(_first_line(cand.error))}")
        elif cand.verdict == DISAGREES:
            bad = [o for o in cand.outputs if not o.agrees]
            parts = [f"<code>{esc(o.name)}</code> ({esc(o.problem) if o.problem else _outside(o)})" for o in bad[:3]]
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            out.append(f"{who} disagrees with the baseline: " + ", ".join(parts) + more)
        elif cand.verdict == NOT_COMPARED:
            out.append(f"{who} was not compared: the baseline has no outputs")
    for cand in c.slow:
        out.append(f"<b>{esc(cand.label)}</b> is {times(cand.slowdown, '×')} the baseline's p50 latency "
                   f"(at most {esc(c.settings.get('max_slowdown'))}× allowed)")  # fmt: skip
    return out or ["the comparison did not pass"]


def _outside(o: OutputAgreement) -> str:
    return f"{count(o.outside)} of {count(o.elements)} elements outside the tolerance"


def _first_line(text: str | None, limit: int = 240) -> str:
    lines = (text or "").strip().splitlines()
    return clip(lines[0], limit) if lines else "no error message"


def _facts(c: Comparison) -> str:
    m, s, i = c.machine, c.settings, c.inputs
    gpus = m.get("gpus") or []
    gpu_text = "; ".join(f"{g.get('name', 'GPU')} ({size(g['memory']) if g.get('memory') else '?'})" for g in gpus)
    if gpus and m.get("gpu_driver"):
        gpu_text += f"; driver {m['gpu_driver']}"
    speed = "not measured" if not s.get("speed", True) else "; ".join(x for x in (
        f"{s.get('warmup', '?')} warm-up calls, then {s.get('duration', '?')} s per measurement",
        f"batch sizes {', '.join(str(b) for b in s.get('batch_sizes') or []) or 'none'}",
        f"at {s['rate']:g} calls/s" if s.get("rate") else "no target rate",
        f"max slowdown {s['max_slowdown']:g}×" if s.get("max_slowdown") is not None else "no max slowdown",
    ))  # fmt: skip
    rows = [
        ("Date", c.date),
        ("Machine", f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores; {m.get('os', '?')}; "
                    f"Python {m.get('python', '?')}"),
        ("GPUs", gpu_text or "none found (NVML)"),
        ("neuropod", c.neuropod_version),
        ("Inputs", f"{i.get('source', '?')}: {plural(int(i.get('sets', 0)), 'set')}"),
        ("Tolerance", f"rtol {s.get('rtol', '?')}, atol {s.get('atol', '?')} (floats: numpy.isclose, NaN equals NaN; "
                      "strings, bytes, integers and booleans: equal)"),
        ("Speed", speed),
    ]  # fmt: skip
    if s.get("maps"):
        rows.append(("Maps", ", ".join(str(x) for x in s["maps"])))
    out = [f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows]
    shapes = _shapes(i.get("tensors") or [])
    if shapes:
        out.insert(5, f'<dt>Input tensors</dt><dd class="mono">{shapes}</dd>')
    return "".join(out)


def _shapes(tensors: Sequence[dict[str, Any]]) -> str:
    """Each input set's tensors (dtype and shape), sets that look alike shown once."""
    groups: list[tuple[list[int], str]] = []
    for n, t in enumerate(tensors):
        text = ", ".join(f"{name} {d.get('dtype', '?')} {list(d.get('shape', []))}" for name, d in t.items())
        if groups and groups[-1][1] == text:
            groups[-1][0].append(n + 1)
        else:
            groups.append(([n + 1], text))
    lines = []
    for sets, text in groups[:10]:
        which = f"set {sets[0]}" if len(sets) == 1 else f"sets {sets[0]}–{sets[-1]}"
        lines.append(f"{esc(which)}: {esc(text)}" if len(tensors) > 1 else esc(text))
    if len(groups) > 10:
        lines.append(f"… and {len(groups) - 10} more")
    return "<br>".join(lines)


# --- the verdict table ------------------------------------------------------------------------------------


def _candidates(c: Comparison) -> str:
    cands = c.candidates
    timed = any(x.latency for x in cands)
    gpu = any(x.memory.gpu_bytes is not None for x in cands)
    # One unit for the latency columns, so digits compare, unless the figures span more than 100x
    # (then 11,553 µs would read worse than 11.6 ms).
    figures = [v for x in cands if x.latency for v in (x.latency.p50, x.latency.p99, x.latency.mean) if v > 0]
    unit = time_unit(figures) if figures and max(figures) / min(figures) < 100 else None
    load_unit = time_unit([x.load_s for x in cands])
    rows = [_candidate_row(c, i, x, timed=timed, gpu=gpu, unit=unit, load_unit=load_unit) for i, x in enumerate(cands)]
    group = '<th colspan="6" class="num">latency, one call at a time</th>' if timed else ""
    head = (
        f'<thead><tr class="group"><th colspan="5"></th>{group}<th colspan="{2 if gpu else 1}" class="num">memory</th>'
        "</tr><tr><th>Candidate</th><th>Verdict</th><th>Backend</th><th>Device</th><th class=num>Load</th>"
        + ("<th class=num>p50</th><th class=num>p90</th><th class=num>p99</th><th class=num>mean</th>"
           "<th class=num>stdev</th><th class=num>vs baseline</th>" if timed else "")
        + "<th class=num>peak RSS<span class=sub>added</span></th>" + ("<th class=num>GPU</th>" if gpu else "")
        + "</tr></thead>"
    )  # fmt: skip
    notes = [
        "The first candidate is the baseline. Load: opening the package and loading the model.",
        '"vs baseline": p50 latency over the baseline\'s (2.00× is twice as slow).' if timed else
        "No latency was measured.",
        "Peak RSS sums the candidate's processes (its workers' too); under it, what loading and running the model "
        "added to the process.",
        "GPU: peak GPU memory of the candidate's processes (NVML)." if gpu else
        "No GPU memory was measured (no NVIDIA GPU seen through NVML).",
    ]  # fmt: skip
    table = f'<div class="scroll"><table class="wide">{head}<tbody>{"".join(rows)}</tbody></table></div>'
    return f'<section id="candidates"><h2>Candidates</h2>{table}<p class="note">{esc(" ".join(notes))}</p></section>'


def _candidate_row(c: Comparison, i: int, x: CandidateResult, *, timed: bool, gpu: bool,
                   unit: tuple[float, str] | None, load_unit: tuple[float, str]) -> str:  # fmt: skip
    badges = _badge(x.verdict) + (_badge("slow") if x in c.slow else "")
    given = f'<span class="sub mono">{esc(x.given)}</span>' if x.given != x.label else ""
    facts = ", ".join(([f"model {x.model_name}"] if x.model_name else [])
                      + ([f"package {size(x.package_bytes)}"] if x.package_bytes is not None else []))  # fmt: skip
    where = ", ".join(v for v in (x.location, "OPE worker" if x.use_ope else None,
                                  "served" if x.remote and x.location != "remote" else None) if v)  # fmt: skip
    speed = []
    if x.latency:
        lat, limit = x.latency, c.settings.get("max_slowdown")
        speed = [_td(duration(v, unit), "num") for v in (lat.p50, lat.p90, lat.p99, lat.mean, lat.stdev)]
        slow = "baseline" if i == 0 else times(x.slowdown, "×")
        speed.append(_td(esc(slow), "num bad" if limit is not None and (x.slowdown or 0) > limit else "num"))
    elif timed:
        speed = [f'<td colspan="6" class="num">{"failed: no figures" if not x.ok else "not measured"}</td>']
    added = f'<span class="sub">+{size(x.memory.added_rss)}</span>' if x.memory.added_rss is not None else ""
    cells = [
        f'<td class="who">{_swatch(i, x)}<span class="label">{esc(x.label)}</span>{given}'
        f'<span class="sub">{esc(facts)}</span></td>',
        _td(badges),
        _td(f"{esc(x.backend or '-')}<span class=\"sub\">{esc(x.framework or '')}</span>", "nw"),
        _td(f"{esc(x.device or '-')}<span class=\"sub\">{esc(where)}</span>"),
        _td(duration(x.load_s, load_unit), "num"),
        *speed,
        _td(size(x.memory.peak_rss) + added, "num"),
        *([_td(size(x.memory.gpu_bytes), "num")] if gpu else []),
    ]  # fmt: skip
    return "<tr>" + "".join(cells) + "</tr>"


def _failures(c: Comparison) -> str:
    failed = [(i, x) for i, x in enumerate(c.candidates) if not x.ok]
    if not failed:
        return ""
    parts = [f"<h3>{_swatch(i, x)}{esc(x.label)} failed at {esc(x.stage or 'run')}</h3>"
             f'<div class="error"><pre>{esc(x.error or "no error message")}</pre></div>'
             for i, x in failed]  # fmt: skip
    note = '<p class="note">A failed candidate is left out of the charts\' figures; the others are still compared.</p>'
    return '<section id="failures"><h2>Failed candidates</h2>' + "".join(parts) + note + "</section>"


# --- agreement --------------------------------------------------------------------------------------------


def _agreement(c: Comparison) -> str:
    if len(c.candidates) == 1:
        return ('<section id="agreement"><h2>Agreement with the baseline</h2><p class="note">Only one candidate ran: '
                "give two or more to compare their outputs.</p></section>")  # fmt: skip
    s = c.settings
    parts = [f'<p class="note">Each output of each candidate against the baseline\'s ({esc(c.baseline.label)}), over '
             f"{plural(int(c.inputs.get('sets', 0)), 'input set')}. Floats agree within atol + rtol × |baseline| "
             f"(rtol {esc(s.get('rtol', '?'))}, atol {esc(s.get('atol', '?'))}).</p>"]  # fmt: skip
    for i, x in enumerate(c.candidates[1:], start=1):
        parts.append(f"<h3>{_swatch(i, x)}{esc(x.label)} {_badge(x.verdict)}</h3>")
        if not x.outputs:
            said = [n for n in x.notes if n.startswith("not compared")]
            why = (
                f"failed at {x.stage or 'run'} before its outputs could be compared"
                if not x.ok
                else (said[0] if said else "not compared")
            )
            parts.append(f'<p class="note">{esc(why)}</p>')
            continue
        parts.append(_output_table(x.outputs))
        for o in x.outputs:
            if o.worst and not o.agrees:
                parts.append(_worst_table(o))
    return '<section id="agreement"><h2>Agreement with the baseline</h2>' + "".join(parts) + "</section>"


def _output_table(outputs: Sequence[OutputAgreement]) -> str:
    rows = []
    for o in outputs:
        verdict = _badge(AGREES if o.agrees else DISAGREES)
        first = f'<td class="mono">{esc(o.name)}</td><td class="mono">{esc(o.dtype)}</td>'
        how = "exact" if o.exact else "within tolerance"
        if o.problem:
            rows.append(f"<tr>{first}<td>{how}</td><td colspan=\"6\" class=\"bad\">{esc(o.problem)}</td>"
                        f"<td>{verdict}</td></tr>")  # fmt: skip
            continue
        infinite = not o.exact and o.outside > 0
        cells = [
            _td(how), _td(count(o.elements), "num"), _td(count(o.outside), "num bad" if o.outside else "num"),
            _td(share(o.share_outside), "num bad" if o.outside else "num"),
            _td("-" if o.exact else error(o.max_abs_error, infinite=infinite), "num"),
            _td("-" if o.exact else error(o.max_rel_error, infinite=infinite), "num"), _td(verdict),
        ]  # fmt: skip
        rows.append(f"<tr>{first}{''.join(cells)}</tr>")
    head = ("<tr><th>Output</th><th>dtype</th><th>Compared</th><th class=num>elements</th>"
            "<th class=num>outside</th><th class=num>share outside</th><th class=num>max abs error</th>"
            "<th class=num>max rel error</th><th>Verdict</th></tr>")  # fmt: skip
    return _table(head, rows)


def _worst_table(o: OutputAgreement) -> str:
    rows = []
    for w in o.worst:
        index = "[" + ", ".join(str(k) for k in w.index) + "]"
        rows.append(
            f'<tr><td class="num">{w.input_set + 1}</td><td class="mono">{esc(index)}</td>'
            f'<td class="mono num">{esc(element(w.value, o.dtype))}</td>'
            f'<td class="mono num">{esc(element(w.baseline, o.dtype))}</td>'
            f'<td class="num">{"-" if o.exact else error(w.abs_error, infinite=True)}</td>'
            f'<td class="num">{"-" if o.exact else error(w.rel_error, infinite=True)}</td></tr>'
        )
    head = ("<tr><th class=num>input set</th><th>index</th><th class=num>value</th><th class=num>baseline</th>"
            "<th class=num>abs error</th><th class=num>rel error</th></tr>")  # fmt: skip
    title = f"<h4>Worst elements of <code>{esc(o.name)}</code></h4>"
    return title + _table(head, rows)


# --- charts and notes -------------------------------------------------------------------------------------


def _figure(svg: str | None, missing: str) -> str:
    return f"<figure>{svg}</figure>" if svg else f'<p class="note">{esc(missing)}</p>'


def _speed(c: Comparison) -> str:
    if not c.settings.get("speed", True):
        return ('<section id="speed"><h2>Speed</h2><p class="note">Speed was not measured (--no-speed): '
                "this comparison checked agreement only.</p></section>")  # fmt: skip
    parts = [
        _figure(latency_chart(c), "No candidate has latency figures."),
        _figure(throughput_chart(c), "No throughput figures: the inputs share no batch symbol (a first dimension "
                "every input has), or no batch sizes were asked for."),
        _throughput_table(c),
    ]  # fmt: skip
    if c.settings.get("rate"):
        parts.append(_figure(rate_chart(c), f"No candidate has figures at {c.settings['rate']:g} calls per second."))
        parts.append(_rate_table(c))
    return '<section id="speed"><h2>Speed</h2>' + "".join(parts) + "</section>"


def _throughput_table(c: Comparison) -> str:
    """The throughput chart's figures in full: items per second and the p50 time of one call, per batch size."""
    sizes = sorted({t.batch_size for x in c.candidates for t in x.throughput})
    if not sizes:
        return ""
    rows = []
    for i, x in enumerate(c.candidates):
        if not x.throughput:
            continue
        by = {t.batch_size: t for t in x.throughput}
        cells = "".join(
            _td(f"{count(by[b].items_per_s)}<span class=sub>{duration(by[b].p50)} per call</span>", "num")
            if b in by else _td("-", "num") for b in sizes
        )  # fmt: skip
        rows.append(f"<tr><td>{_swatch(i, x)}{esc(x.label)}</td>{cells}</tr>")
    head = "<tr><th>Items per second</th>" + "".join(f"<th class=num>batch {b}</th>" for b in sizes) + "</tr>"
    return _table(head, rows)


def _rate_table(c: Comparison) -> str:
    """The latency at the target rate in figures, with the rate each candidate reached."""
    rows = []
    for i, x in enumerate(c.candidates):
        if x.server is None:
            continue
        srv = x.server
        reached = f"{srv.achieved_rate:.3g}/s" if srv.achieved_rate is not None else "-"
        cells = [_td(duration(v), "num") for v in (srv.p50, srv.p90, srv.p99, srv.mean, srv.max)]
        rows.append(f"<tr><td>{_swatch(i, x)}{esc(x.label)}</td>{''.join(cells)}{_td(reached, 'num')}"
                    f"{_td(count(srv.count), 'num')}</tr>")  # fmt: skip
    if not rows:
        return ""
    head = ("<tr><th>At the target rate</th><th class=num>p50</th><th class=num>p90</th><th class=num>p99</th>"
            "<th class=num>mean</th><th class=num>max</th><th class=num>reached</th>"
            "<th class=num>calls</th></tr>")  # fmt: skip
    return _table(head, rows)


def _memory(c: Comparison) -> str:
    return ('<section id="memory"><h2>Memory</h2>'
            + _figure(memory_chart(c), "No candidate has memory figures.") + "</section>")  # fmt: skip


def _notes(c: Comparison) -> str:
    notes = [esc(n) for n in c.problem_notes]
    for x in c.candidates:
        notes += [f"<b>{esc(x.label)}</b>: {esc(n)}" for n in x.notes]
        if x.memory.note:
            notes.append(f"<b>{esc(x.label)}</b>: memory {esc(x.memory.note)}")
    if not notes:
        return ""
    return (
        '<section id="notes"><h2>Notes</h2><ul class="notes">'
        + "".join(f"<li>{n}</li>" for n in notes)
        + ("</ul></section>")
    )


def _method(c: Comparison) -> str:
    """How the figures were made, for a reader who was not there."""
    s = c.settings
    steps = [esc(c.method)]
    if s.get("speed", True):
        duration_s = esc(s.get("duration", "?"))
        steps += [
            f"Latency, one call at a time: {esc(s.get('warmup', '?'))} warm-up calls, then calls one after another "
            f"for {duration_s} s and at least 20 calls, on the first input set.",
            "Throughput: calls of one batch (the first input set's rows repeated or cut to the batch size) back to "
            f"back for "
            f"{duration_s} s; items per second counts rows.",
        ]  # fmt: skip
        if s.get("rate"):
            steps.append(
                f"At a rate: calls due at Poisson-distributed times, {s['rate']:g} per second on average, "
                f"sent by {SERVER_THREADS} threads; a call's latency counts from when it was due."
            )
    steps += [
        "Memory: the peak resident set (VmHWM) summed over the candidate's process and the processes it started; "
        "GPU memory: what NVML reports for those processes, sampled while they ran.",
        f"Agreement: every output of every input set against the baseline's; floats with numpy.isclose (rtol "
        f"{esc(s.get('rtol', '?'))}, atol {esc(s.get('atol', '?'))}, NaN equal to NaN), other types exactly.",
    ]  # fmt: skip
    items = "".join(f"<li>{x}</li>" for x in steps)
    return f'<section id="method"><h2>How the figures were made</h2><ul class="notes">{items}</ul></section>'
