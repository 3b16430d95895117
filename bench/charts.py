"""Draw the benchmarks' JSON output as SVG charts for the documentation.

    python bench/charts.py [--data docs/_static/perf/data] [--out docs/_static/perf]

Reads the files the in-process benches write with ``--json`` (``onnx.json``,
``torchscript.json``, ``torch.json``, ``jax.json``, ``tensorflow.json``,
``ope.json``) and bench_serve.py's (``serve.json``), and writes one SVG per chart. A chart whose data files are
missing is skipped with a note. Every chart's footer says the command that
produced each figure, the machine (CPU model and count, OS, Python), the
framework versions and the date, all read from the JSON.

``nox -s charts`` runs the quick benches into the data folder and then this
script; ``nox -s charts -- --from-data`` only redraws from the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (label, bench file, result key, target on the chart's measure or None)
TINY = [
    ("ONNX Runtime", "onnx", "tiny", 3.0),
    ("TorchScript", "torchscript", "tiny", 5.0),
    ("torch.export", "torch", "torch_export tiny", 3.0),
    ("AOTInductor", "torch", "aoti tiny", 3.0),
    ("JAX", "jax", "tiny", 3.0),
    ("TensorFlow (raw: the callable\nneuropod runs)", "tensorflow", "tiny_own", None),
]
LARGE = [
    ("ONNX Runtime, ~1 ms MLP", "onnx", "1ms", 1.02),
    ("TorchScript, ~1 ms MLP", "torchscript", "1ms", 1.02),
    ("torch.export, MLP", "torch", "torch_export mlp", 1.01),
    ("AOTInductor, MLP", "torch", "aoti mlp", 1.01),
    ("JAX, MLP", "jax", "mlp", 1.01),
    ("TensorFlow, tiny graph\n(raw: Session.run)", "tensorflow", "tiny", 1.05),
    ("TensorFlow, object detection\n(raw: Session.run)", "tensorflow", "detection", 1.02),
]
OPE = [
    ("tiny (two 2x2 inputs)", "tiny", 50.0),
    ("100 inputs of 10x5", "100 small inputs", 100.0),
    ("6.9 MB image,\nzero-copy (model.empty)", "image zero-copy", 100.0),
    ("6.9 MB image, copied", "image copied", None),
]

OURS, RAW, MISS = "#2f6db5", "#a9b4c2", "#c0392b"

# bench_serve.py's cells drawn, (protocol, model, concurrency, title), and its servers, (label, name, colour):
# MLServer's row is its faster configuration in the cell.
SERVE_CELLS = [
    ("rest", "tiny", 1, "REST, tiny model, 1 client"),
    ("rest", "tiny", 32, "REST, tiny model, 32 clients"),
    ("rest", "small_inputs_100", 8, "REST, 100 inputs of 10x5, 8 clients"),
    ("grpc", "tiny", 32, "gRPC, tiny model, 32 clients"),
]
SERVE_SERVERS = [
    ("neuropod", "neuropod serve, binary tensors", OURS),
    ("neuropod (JSON)", "neuropod serve, JSON", "#6f9fd8"),
    ("mlserver", "MLServer (JSON on REST)", "#e08a3c"),
    ("litserve (JSON)", "LitServe (its JSON API)", "#8e6bbf"),
    ("floor", "floor: bare Starlette / grpcio, no model", RAW),
    ("floor (JSON)", "floor, JSON (orjson, numpy), no model", "#cfd6de"),
]


def load(data: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(data.glob("*.json")):
        found[path.stem] = json.loads(path.read_text())
    return found


def result(doc: dict[str, Any], key: str) -> dict[str, Any] | None:
    for r in doc["results"]:
        if r.get("key") == key:
            return r
    return None


def footer(docs: list[dict[str, Any]]) -> str:
    """Command, machine, versions and date of every bench a chart draws from."""
    lines = []
    machines = {json.dumps(d["machine"], sort_keys=True) for d in docs}
    for d in docs:
        versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items() if k not in ("numpy", "torch_threads"))
        lines.append(f"$ {d['command']}   ({versions}; {d['date']})")
    for m in sorted(machines):
        mm = json.loads(m)
        lines.append(f"Machine: {mm['cpu']}, {mm['cpu_count']} CPUs ({mm['arch']}), {mm['system']}, "
                     f"Python {mm['python']}. Medians; see each bench for its rounds.")  # fmt: skip
    return "\n".join(lines)


def _figure(plt: Any, rows: int, docs: list[dict[str, Any]], width: float = 9.0) -> tuple[Any, Any]:
    foot = footer(docs)
    height = 0.55 * rows + 1.6 + 0.2 * foot.count("\n")
    fig, ax = plt.subplots(figsize=(width, height))
    fig.text(0.01, 0.01, foot, fontsize=6.5, family="monospace", va="bottom", ha="left", color="#444444")
    fig.subplots_adjust(left=0.3, right=0.97, top=1 - 0.75 / height, bottom=(0.55 + 0.13 * (foot.count("\n") + 1)) / height)
    return fig, ax


def chart_tiny(plt: Any, docs: dict[str, dict[str, Any]], out: Path) -> str | None:
    rows = [(label, docs[b], result(docs[b], key), target) for label, b, key, target in TINY if b in docs]
    rows = [r for r in rows if r[2] is not None]
    if not rows:
        return None
    used = list({id(d): d for _, d, _, _ in rows}.values())
    fig, ax = _figure(plt, int(len(rows) * 1.4), used)
    ys = range(len(rows))
    raw = [r[2]["raw"] * 1e6 for r in rows]
    ours = [r[2]["neuropod"] * 1e6 for r in rows]
    ax.barh([y + 0.2 for y in ys], raw, height=0.38, color=RAW, label="framework alone")
    ax.barh([y - 0.2 for y in ys], ours, height=0.38, color=OURS, label="through neuropod (model.infer)")
    top = max(max(raw), max(ours))
    for y, (_, _, r, target) in zip(ys, rows):
        added = r["overhead"] * 1e6
        note = f"{added:+.1f} µs"
        if target is not None:
            note += f" (target ≤ {target:g}: {'met' if added <= target else 'not met'})"
        ax.text(max(r["raw"], r["neuropod"]) * 1e6 + top * 0.02, y, note, va="center", fontsize=8,
                color=MISS if target is not None and added > target else "black")  # fmt: skip
    ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.75)
    ax.set_xlabel("µs per call (median), tiny model: two adds of 2x2 float32")
    ax.set_title("Tiny model: time per call, and what neuropod adds", fontsize=11)
    ax.legend(loc="lower right", fontsize=8)
    path = out / "tiny-overhead.svg"
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path.name


def chart_large(plt: Any, docs: dict[str, dict[str, Any]], out: Path) -> str | None:
    rows = [(label, docs[b], result(docs[b], key), target) for label, b, key, target in LARGE if b in docs]
    rows = [r for r in rows if r[2] is not None]
    if not rows:
        return None
    used = list({id(d): d for _, d, _, _ in rows}.values())
    fig, ax = _figure(plt, len(rows), used)
    ys = list(range(len(rows)))
    ratios = [r[2]["ratio"] for r in rows]
    colors = [OURS if t is None or q <= t else MISS for q, (_, _, _, t) in zip(ratios, rows)]
    ax.barh(ys, ratios, height=0.6, color=colors)
    ax.axvline(1.0, color="black", lw=0.8)
    for y, q, (_, _, r, t) in zip(ys, ratios, rows):
        ms = r["raw"] * 1e3
        ax.text(max(q, 1.0) + 0.02, y, f"{q:.3f}  (raw {ms:.3g} ms; target ≤ {t:g})", va="center", fontsize=8)
    ax.set_yticks(ys, [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.8, max(ratios) * 1.6))
    ax.set_xlabel("time through neuropod / time of the framework alone (median of per-round ratios)")
    ax.set_title("Larger models: ratio against the raw framework (1.0 = no cost)", fontsize=11)
    path = out / "large-ratio.svg"
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path.name


def chart_ope(plt: Any, docs: dict[str, dict[str, Any]], out: Path) -> str | None:
    doc = docs.get("ope")
    if doc is None:
        return None
    rows = [(label, result(doc, key), target) for label, key, target in OPE]
    rows = [r for r in rows if r[1] is not None]
    fig, ax = _figure(plt, len(rows), [doc])
    ys = list(range(len(rows)))
    added = [r[1]["overhead"] * 1e6 for r in rows]
    colors = [OURS if t is None or a <= t else MISS for a, (_, _, t) in zip(added, rows)]
    ax.barh(ys, added, height=0.6, color=colors)
    for y, a, (_, r, t) in zip(ys, added, rows):
        note = f"+{a:.1f} µs (in-process {r['raw'] * 1e6:.1f} µs)"
        if t is not None:
            note += f", target ≤ {t:g}"
            ax.plot([t, t], [y - 0.35, y + 0.35], color="black", lw=1.2)
        ax.text(max(a, t or 0) + max(added) * 0.02, y, note, va="center", fontsize=8)
    start = result(doc, "start")
    title = "Out-of-process execution: latency a worker adds per call"
    if start is not None:
        title += f"\n(worker start + model load: {start['seconds'] * 1e3:.0f} ms)"
    ax.set_yticks(ys, [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(added) * 1.9)
    ax.set_xlabel("µs added per call (median of per-pair differences); black marks: targets")
    ax.set_title(title, fontsize=11)
    path = out / "ope-added.svg"
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path.name


def chart_formats(plt: Any, docs: dict[str, dict[str, Any]], out: Path) -> str | None:
    doc = docs.get("torch")
    if doc is None:
        return None
    rows = [r for r in doc["results"] if str(r.get("key", "")).startswith("format ")]
    if not rows:
        return None
    foot = footer([doc])
    height = 3.6 + 0.2 * foot.count("\n")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.0, height))
    fig.text(0.01, 0.01, foot, fontsize=6.5, family="monospace", va="bottom", ha="left", color="#444444")
    fig.subplots_adjust(left=0.17, right=0.97, wspace=0.55, top=1 - 0.75 / height,
                        bottom=(0.75 + 0.13 * (foot.count("\n") + 1)) / height)  # fmt: skip
    names = [r["name"] for r in rows]
    ys = list(range(len(rows)))
    mlp = doc.get("mlp", {})
    for ax, field, label in ((a1, "tiny_us", "tiny model, µs per call"),
                             (a2, "mlp_ms", f"MLP {mlp.get('layers', '?')}x{mlp.get('width', '?')} "
                                            f"batch {mlp.get('batch', '?')}, ms per call")):  # fmt: skip
        values = [r[field] for r in rows]
        ax.barh(ys, values, height=0.6, color=OURS)
        for y, v in zip(ys, values):
            ax.text(v + max(values) * 0.02, y, f"{v:.3g}", va="center", fontsize=8)
        ax.set_yticks(ys, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.25)
        ax.set_xlabel(label, fontsize=8)
    fig.suptitle("One model through every PyTorch format (through neuropod)", fontsize=11)
    path = out / "pytorch-formats.svg"
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path.name


def chart_serve(plt: Any, docs: dict[str, dict[str, Any]], out: Path) -> str | None:
    doc = docs.get("serve")
    if doc is None:
        return None
    cells = doc["cells"]

    def rps(protocol: str, model: str, c: int, label: str) -> float | None:
        found = [x["rps"] for x in cells if (x["protocol"], x["model"], x["concurrency"]) == (protocol, model, c)
                 and (x["server"] == label or (label == "mlserver" and x["server"].startswith("mlserver")))]  # fmt: skip
        found = [v for v in found if v]
        return max(found) if found else None

    groups = [(title, [(name, color, rps(p, m, c, label)) for label, name, color in SERVE_SERVERS])
              for p, m, c, title in SERVE_CELLS]  # fmt: skip
    groups = [(t, [b for b in bars if b[2] is not None]) for t, bars in groups]
    groups = [g for g in groups if g[1]]
    if not groups:
        return None
    foot = footer([doc])
    lines = foot.count("\n") + 1
    height = 1.2 + 0.32 * sum(len(b) + 1.4 for _, b in groups) + 0.14 * lines
    fig, axes = plt.subplots(len(groups), 1, figsize=(9.0, height), squeeze=False)
    fig.text(0.01, 0.01, foot, fontsize=6.5, family="monospace", va="bottom", ha="left", color="#444444")
    fig.subplots_adjust(left=0.33, right=0.97, top=1 - 0.7 / height, hspace=0.9,
                        bottom=(0.55 + 0.13 * lines) / height)  # fmt: skip
    for ax, (title, bars) in zip(axes[:, 0], groups):
        ys = list(range(len(bars)))
        values = [v for _, _, v in bars]
        ax.barh(ys, values, height=0.7, color=[c for _, c, _ in bars])
        for y, v in zip(ys, values):
            ax.text(v + max(values) * 0.01, y, f"{v:,.0f}", va="center", fontsize=7.5)
        ax.set_yticks(ys, [n for n, _, _ in bars], fontsize=7.5)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.15)
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("requests per second (median of rounds): server on one core, load on the other", fontsize=8)
    fig.suptitle("Serving: requests per second against peers and a bare floor", fontsize=11)
    path = out / "serve-rps.svg"
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "docs/_static/perf/data", help="the benches' JSON files")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/_static/perf", help="where the SVG files go")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    # Reproducible SVG: no creation date in the metadata, fixed ids, text as paths.
    plt.rcParams.update({"svg.hashsalt": "neuropod", "svg.fonttype": "path", "font.family": "DejaVu Sans"})
    docs = load(args.data)
    if not docs:
        sys.exit(f"no benchmark JSON in {args.data}: run the benches with --json first (nox -s charts)")
    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (chart_tiny, chart_large, chart_ope, chart_formats, chart_serve):
        name = draw(plt, docs, args.out)
        print(f"wrote {args.out / name}" if name else f"{draw.__name__}: no data, skipped")


if __name__ == "__main__":
    main()
