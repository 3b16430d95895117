"""The report of ``neuropod compare``: the HTML page (self-contained, well-formed, escaped, every figure
shown), its SVG charts, and the terminal table. Comparisons are built from the result dataclasses
(this test session has no backend framework), with figures like those of a real run."""

from __future__ import annotations

import html
import random
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from html.parser import HTMLParser
from typing import ClassVar

import pytest

from neuropod.comparison.charts import latency_chart, memory_chart, throughput_chart
from neuropod.comparison.html import render_html
from neuropod.comparison.results import (
    AGREES,
    BASELINE,
    DISAGREES,
    FAILED,
    NOT_COMPARED,
    CandidateResult,
    Comparison,
    Latency,
    Memory,
    OutputAgreement,
    Throughput,
    Worst,
)
from neuropod.comparison.svg import Axis, esc, linear_ticks
from neuropod.comparison.text import render_table
from neuropod.comparison.units import compact, duration, error, share, size, time_unit, times

HOSTILE = "<script>alert(1)</script>"
QUOTES = 'it\'s "quoted" & <b>bold</b>'


def latency(p50: float, spread: float, n: int, seed: int) -> Latency:
    """A latency record of ``n`` calls around ``p50``, its percentiles computed from its own samples."""
    rng = random.Random(seed)
    samples = sorted(p50 * rng.lognormvariate(0, spread) for _ in range(n))

    def q(p: float) -> float:
        return samples[round(p * (n - 1))]

    mean = sum(samples) / n
    stdev = (sum((s - mean) ** 2 for s in samples) / n) ** 0.5
    return Latency(count=n, p50=q(0.5), p90=q(0.9), p99=q(0.99), mean=mean, stdev=stdev, min=samples[0],
                   max=samples[-1], samples=samples)  # fmt: skip


def candidate(
    label: str, given: str, backend: str, framework: str, p50: float, seed: int, **kw: object
) -> CandidateResult:
    lat = latency(p50, 0.15, 500, seed)
    fields: dict[str, object] = dict(
        label=label, given=given, target=given.partition("@")[0], model_name="adder", backend=backend,
        framework=framework, location="in-process", device="cpu", package_bytes=2061 + seed, load_s=0.06 * seed,
        latency=lat, throughput=[Throughput(b, 1000, 0.3, b / (lat.p50 * (1 + 0.1 * b)), lat.p50) for b in (1, 8, 32)],
        memory=Memory(rss_before_load=41_205_760, peak_rss=41_205_760 + seed * 20_000_000),
        server=replace(latency(p50 * 60, 0.6, 54, seed + 10), rate=200.0, achieved_rate=181.2),
    )  # fmt: skip
    fields.update(kw)
    return CandidateResult(**fields)  # type: ignore[arg-type]


def agreeing(name: str = "out") -> OutputAgreement:
    return OutputAgreement(name=name, dtype="float32", exact=False, elements=64, outside=0, max_abs_error=2.4e-7,
                           max_rel_error=1.1e-7)  # fmt: skip


def comparison(candidates: list[CandidateResult], **settings: object) -> Comparison:
    base = {"rtol": 1e-4, "atol": 1e-5, "speed": True, "warmup": 10, "duration": 2.0, "batch_sizes": [1, 8, 32],
            "rate": None, "max_slowdown": None, "seed": 0, "use_ope": False, "timeout": 600.0, "maps": []}  # fmt: skip
    base.update(settings)
    return Comparison(
        candidates=candidates, settings=base,
        inputs={"source": "the test data bundled in onnx", "sets": 2,
                "tensors": [{name: {"dtype": "float32", "shape": [8, 8]} for name in "xy"}] * 2},
        problem_notes=["symbol 'batch' of torch is 'batch_size' of the baseline"],
        machine={"cpu": "AMD EPYC 7B13", "cores": 2, "os": "Linux-6.1-x86_64", "python": "3.11.7", "hostname": "vm",
                 "gpus": [{"name": "NVIDIA H200", "memory": 150_000_000_000}], "gpu_driver": "570.1"},
        command="neuropod compare onnx=adder.onnx.neuropod torch=adder.pt2.neuropod --rate 200",
        date="2026-11-29T20:25:42+00:00", neuropod_version="0.4.0",
        method="Each candidate ran alone in a fresh process, one after another.",
    )  # fmt: skip


@pytest.fixture
def rich() -> Comparison:
    """Five candidates: the baseline, one that agrees, one that disagrees (its worst elements listed), one that
    failed to load (a hostile label, an error with markup and several lines), and one served with GPU memory."""
    base = candidate("onnx", "onnx=adder.onnx.neuropod", "onnx==1.31.1", "onnxruntime 1.31.1", 4.3e-6, 1,
                     verdict=BASELINE)  # fmt: skip
    torch = candidate("torch", "torch=adder.pt2.neuropod", "torch", "torch 2.13.0", 18e-6, 2, verdict=AGREES,
                      outputs=[agreeing()], slowdown=18e-6 / 4.3e-6)  # fmt: skip
    worst = [Worst(1, [3, 5], 7.25, 6.25, 1.0, 0.16), Worst(0, [0, 2], 1.5, 1.4375, 0.0625, 0.0435)]
    perturbed = candidate(
        "perturbed", "perturbed=adder.bad.neuropod", "onnx==1.31.1", "onnxruntime 1.31.1", 4.4e-6, 3, verdict=DISAGREES,
        outputs=[OutputAgreement("out", "float32", False, 128, 2, 1.0, 0.16, worst),
                 OutputAgreement("label_out", "string", True, 16, 1, worst=[Worst(0, [7], "cat", "dog")])],
    )  # fmt: skip
    failed = CandidateResult(label=HOSTILE, given=f"{HOSTILE}=adder.neuropod@tensorflow", target="adder.neuropod",
                             status=FAILED, stage="load", verdict=FAILED,
                             error=f"no backend for tensorflow {QUOTES}\nTraceback line two")  # fmt: skip
    served = candidate(QUOTES, "grpc://localhost:8001/adder", "remote", "neuropod-serving 0.4.0", 120e-6, 4,
                       verdict=AGREES, outputs=[agreeing()], remote=True, location="remote", device="cuda:0",
                       memory=Memory(gpu_bytes=512 * 2**20), throughput=[])  # fmt: skip
    for c in (torch, perturbed, served):
        c.slowdown = c.latency.p50 / base.latency.p50  # type: ignore[union-attr]
    return comparison([base, torch, perturbed, failed, served], rate=200.0)


class Balanced(HTMLParser):
    """Checks every element the page opens is closed, in order (the void elements aside), and collects
    attributes that could load something."""

    VOID: ClassVar[set[str]] = {
        "meta",
        "br",
        "link",
        "img",
        "input",
        "hr",
        "wbr",
        "col",
        "source",
        "area",
        "base",
        "embed",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.loads: list[tuple[str, str, str | None]] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.loads += [(tag, k, v) for k, v in attrs if k in ("src", "href", "xlink:href", "action", "srcset")]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.loads += [(tag, k, v) for k, v in attrs if k in ("src", "href", "xlink:href", "action", "srcset")]

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def parse(page: str) -> Balanced:
    p = Balanced()
    p.feed(page)
    p.close()
    assert p.stack == [], f"elements left open: {p.stack}"
    return p


def svgs(page: str) -> list[ET.Element]:
    """Each chart, parsed as XML (it must be well-formed to be one)."""
    return [ET.fromstring(block) for block in re.findall(r"<svg\b.*?</svg>", page, flags=re.S)]


def test_the_page_is_well_formed_and_loads_nothing(rich: Comparison) -> None:
    page = render_html(rich)
    parser = parse(page)
    assert parser.loads == []
    assert not parser.tags & {"script", "link", "img", "iframe", "object", "embed", "base", "form"}
    assert "http://" not in page and "https://" not in page
    assert "url(" not in page and "@import" not in page
    charts = svgs(page)
    assert [c.findtext("title") for c in charts] == [
        "Latency, one call at a time",
        "Throughput by batch size",
        "Latency at 200 calls per second",
        "Peak memory",
    ]


def test_the_page_shows_every_candidate_verdict_output_and_worst_element(rich: Comparison) -> None:
    page = render_html(rich)
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    for c in rich.candidates:
        assert esc(c.label) in page
    assert "FAILED" in page and "PASSED" not in page
    for verdict in ("baseline", "agrees", "disagrees", "failed"):
        assert f">{verdict}</span>" in page
    assert "<code>out</code>" in page and "<code>label_out</code>" in page
    assert "[3, 5]" in text and "[7]" in text  # the worst elements' indices
    assert "7.25" in text and "6.25" in text and "'cat'" in text and "'dog'" in text
    assert "failed at load" in text and "Traceback line two" in text
    assert "AMD EPYC 7B13" in text and "NVIDIA H200" in text and "Python 3.11.7" in text
    assert "rtol 0.0001, atol 1e-05" in text and "at 200 calls/s" in text
    assert "x float32 [8, 8]" in text and "sets 1–2" in text
    assert rich.command in text and rich.method in text
    assert "symbol 'batch' of torch" in text  # a problem note
    assert "How the figures were made" in text and "200 per second on average, sent by 8 threads" in text
    base = rich.baseline
    assert base.throughput and base.server is not None
    assert f"{base.throughput[2].items_per_s:,.0f}" in text  # the throughput chart's figures in full
    assert f"{base.server.p99 * 1e6:.0f} µs" in text  # the latency at the target rate


def test_untrusted_text_is_escaped(rich: Comparison) -> None:
    rich.candidates[1].label = "tor\x1bch\x00"  # control characters: not allowed in XML
    rich.candidates[0].notes.append("</li></ul><script>x</script>")
    page = render_html(rich)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert html.escape(QUOTES, quote=True) in page and QUOTES not in page
    assert "\x1b" not in page and "\x00" not in page and "tor\\x1bch\\x00" in page
    parse(page)
    for chart in svgs(page):  # the labels are in the charts too
        assert chart.find(".//script") is None
    assert any(HOSTILE in (t.text or "") for chart in svgs(page) for t in chart.iter("text"))


def test_a_single_candidate_and_no_speed_render() -> None:
    one = comparison([candidate("onnx", "adder.neuropod", "onnx==1.31.1", "onnxruntime 1.31.1", 4.3e-6, 1,
                                verdict=BASELINE)])  # fmt: skip
    page = render_html(one)
    parse(page)
    assert "PASSED" in page and "Only the baseline" in page and "onnx: the baseline alone" in page
    assert len(svgs(page)) == 3  # latency, throughput, memory; no --rate

    c1 = candidate("a", "a.neuropod", "onnx", "onnxruntime", 1e-3, 1, verdict=BASELINE, latency=None, throughput=[])
    c2 = candidate("b", "b.neuropod", "torch", "torch", 1e-3, 2, verdict=AGREES, latency=None, throughput=[],
                   outputs=[agreeing()])  # fmt: skip
    quiet = comparison([c1, c2], speed=False)
    page = render_html(quiet)
    parse(page)
    assert "Speed was not measured" in page and "<th class=num>p50</th>" not in page
    assert [c.findtext("title") for c in svgs(page)] == ["Peak memory"]
    table = render_table(quiet)
    assert "Speed: not measured" in table and "p50" not in table
    assert table.splitlines()[0].split() == ["candidate", "verdict", "backend", "load", "peak", "RSS"]  # all on cpu


def test_charts_take_zero_missing_and_failed_figures() -> None:
    flat = Latency(count=20, p50=0.0, p90=0.0, p99=0.0, mean=0.0, stdev=0.0, min=0.0, max=0.0, samples=[0.0] * 20)
    c1 = candidate("zero", "z.neuropod", "onnx", "ort", 1e-6, 1, verdict=BASELINE, latency=flat,
                   throughput=[Throughput(1, 0, 0.3, 0.0, 0.0)], memory=Memory())  # fmt: skip
    c2 = CandidateResult(label="broken", given="b.neuropod", target="b.neuropod", status=FAILED, stage="run",
                         verdict=FAILED, error="")  # fmt: skip
    c3 = candidate("no samples", "n.neuropod", "onnx", "ort", 2e-6, 3, verdict=AGREES, outputs=[agreeing()],
                   latency=replace(latency(2e-6, 0.1, 50, 3), samples=[]))  # fmt: skip
    page = render_html(comparison([c1, c2, c3]))
    parse(page)
    assert len(svgs(page)) == 3
    assert "failed at run: no figures" in page and "no error message" in page
    lone = candidate("lone", "l.neuropod", "onnx", "ort", 2e-6, 3, verdict=NOT_COMPARED,
                     notes=["not compared: the baseline has no outputs"])  # fmt: skip
    page = render_html(comparison([c2, lone]))
    parse(page)
    assert "<b>lone</b> was not compared: the baseline has no outputs" in page
    assert "not compared: the baseline has no outputs" in render_table(comparison([c2, lone]))
    nothing = comparison([c2, replace(c2, label="broken#2")])
    page = render_html(nothing)
    parse(page)
    assert svgs(page) == [] and "No candidate has latency figures" in page and "No throughput figures" in page


def test_throughput_bars_are_drawn_to_scale(rich: Comparison) -> None:
    chart = ET.fromstring(throughput_chart(rich) or "")
    bars = {r.findtext("title", "").split(":")[0]: float(r.get("height", 0)) for r in chart.iter("rect")
            if "items/s at batch 1 " in r.findtext("title", "")}  # fmt: skip
    assert set(bars) == {"onnx", "torch", "perturbed"}  # the failed and the served (no batch symbol) have none
    rate = {c.label: c.throughput[0].items_per_s for c in rich.candidates if c.throughput}
    assert bars["torch"] / bars["onnx"] == pytest.approx(rate["torch"] / rate["onnx"], rel=0.02)
    assert bars["perturbed"] / bars["onnx"] == pytest.approx(rate["perturbed"] / rate["onnx"], rel=0.02)


def test_latency_axis_is_logarithmic_only_for_a_wide_spread(rich: Comparison) -> None:
    wide = ET.fromstring(latency_chart(rich) or "")  # 4 µs to 120 µs
    assert any("(log scale)" in (t.text or "") for t in wide.iter("text"))
    narrow = comparison(rich.candidates[:3])  # 4 µs to 18 µs
    labels = [t.text or "" for t in ET.fromstring(latency_chart(narrow) or "").iter("text")]
    assert "latency per call, µs" in labels and not any("log scale" in t for t in labels)
    assert memory_chart(narrow) is not None


def test_figures_read_with_their_units() -> None:
    assert time_unit([4.316e-6, 2e-3]) == (1e-6, "µs")
    assert (
        duration(4.316e-6) == "4.32 µs"
        and duration(0.2113) == "211 ms"
        and duration(1234e-6, (1e-6, "µs")) == "1,234 µs"
    )
    assert duration(None) == "-" and duration(0.0) == "0 ms"
    assert size(79_622_144) == "75.9 MiB" and size(2061) == "2.01 KiB" and size(512) == "512 B" and size(None) == "-"
    assert size(1023.8 * 1024) == "1,024 KiB" and size(999.7 * 2**20) == "1,000 MiB" and size(3 * 2**40) == "3.00 TiB"
    assert duration(99.97e-6) == "100 µs" and duration(9.999e-3) == "10.0 ms"
    assert compact(213_456.7) == "213k" and compact(1_706_054.9) == "1.71M" and compact(950) == "950"
    assert error(0.0) == "0" and error(1.234e-7) == "1.2e-07" and error(None, infinite=True) == "inf/NaN"
    assert times(4.1605) == "4.16x" and times(27.96, "×") == "28.0×" and times(486.01) == "486x" and times(None) == "-"
    assert share(0.0) == "0%" and share(0.75) == "75%" and share(2 / 16) == "12.5%" and share(1 / 8000) == "0.013%"
    assert linear_ticks(0, 25, 6) == [0, 5, 10, 15, 20, 25]
    assert Axis(1.0, 100.0, 0, 200, log=True)(10.0) == pytest.approx(100.0)
    assert Axis(1.0, 1e4, 0, 300, log=True).ticks() == [1, 10, 100, 1000, 10000]
    assert Axis(1.0, 100.0, 0, 300, log=True).ticks() == [1, 2, 5, 10, 20, 50, 100]


def test_the_terminal_table(rich: Comparison) -> None:
    rich.settings["max_slowdown"] = 2.0
    table = render_table(rich)
    lines = table.splitlines()
    for c in rich.candidates:
        assert c.label.replace("\n", " ") in table
    assert max(len(line) for line in lines[:8]) <= 100
    assert lines[:3] == [  # units under the names; text left-aligned, numbers right-aligned
        "candidate       verdict      backend       device  load  p50  p99 items/s             peak RSS    vs",
        "                                                     ms   µs   µs      @1    @8   @32      MiB  base",
        "--------------  -----------  ------------  ------  ---- ---- ---- ------- ----- ----- -------- -----",
    ]
    base = rich.baseline
    assert base.latency is not None and base.memory.peak_rss is not None
    tp = [
        f"{t.items_per_s / 1e3:.3g}k" if t.items_per_s < 1e6 else f"{t.items_per_s / 1e6:.3g}M" for t in base.throughput
    ]
    assert base.load_s is not None
    assert lines[3].split() == ["onnx", "baseline", "onnx==1.31.1", "cpu", f"{base.load_s * 1e3:.1f}",
                                f"{base.latency.p50 * 1e6:.2f}", f"{base.latency.p99 * 1e6:.2f}", *tp,
                                f"{base.memory.peak_rss / 2**20:.1f}", "base"]  # fmt: skip
    assert lines[6].split() == ["<script>alert…", "failed", *["-"] * 10]  # cut to fit 100 columns
    assert f"{HOSTILE}: FAILED at load: no backend for tensorflow {QUOTES}\n    Traceback line two" in table
    assert (
        "perturbed: output 'out' disagrees in 2 of 128 elements (1.56%); max abs error 1, max rel error 0.16" in table
    )
    assert "    set 2 out[3, 5]: 7.25, baseline 6.25" in table
    assert "    set 1 label_out[7]: 'cat', baseline 'dog'" in table
    assert lines[-1] == f"FAILED: perturbed, {HOSTILE}, torch, {QUOTES}"
    assert "SLOW: torch is 4.20x the baseline's p50 latency (--max-slowdown 2)" in table
    assert f"SLOW: {QUOTES} is 28.0x the baseline's p50 latency" in table
    ok = comparison([rich.candidates[0], rich.candidates[1]])
    assert render_table(ok).splitlines()[-1] == "PASSED: every candidate agrees with the baseline"
