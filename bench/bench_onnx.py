"""Neuropod's ONNX path against onnxruntime called directly, in one run.

    python bench/bench_onnx.py [--rounds 41] [--quick]

Prints, for a tiny model (two 2x2 float32 adds) and for a model calibrated
to take about a millisecond:

* the median per-call time of ``InferenceSession.run`` on the very session
  neuropod loaded (so the only difference is neuropod's own work), the
  median per-call time of ``model.infer``, their ratio, and the median
  per-round overhead in microseconds;

and the time of ``import neuropod`` and of listing backends with four
plugins' entry points present, in fresh interpreters.

Calls are interleaved in rounds (raw, neuropod, neuropod, raw, ...) so that
drift in the machine's speed hits both sides alike; medians over rounds
make one noisy round harmless. Targets (issue 2): tiny overhead <= 3 us,
1 ms model ratio <= 1.02, listing backends < 100 ms with no framework
imported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper

import neuropod
from neuropod.packagers import create_onnx_neuropod


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any] = ()) -> bytes:  # type: ignore[assignment]
    graph = helper.make_graph(nodes, "bench", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def tiny_model() -> tuple[bytes, list[dict[str, Any]], list[dict[str, Any]], dict[str, np.ndarray]]:
    """out = (x + y) + y over 2x2 float32: two adds."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    data = _model(
        [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Add", ["s", "y"], ["out"])],
        [vi("x", f, [2, 2]), vi("y", f, [2, 2])],
        [vi("out", f, [2, 2])],
    )
    spec_in = [{"name": n, "dtype": "float32", "shape": [2, 2]} for n in ("x", "y")]
    spec_out = [{"name": "out", "dtype": "float32", "shape": [2, 2]}]
    rng = np.random.default_rng(0)
    inputs = {n: rng.standard_normal((2, 2)).astype(np.float32) for n in ("x", "y")}
    return data, spec_in, spec_out, inputs


def heavy_model(layers: int, width: int = 256) -> tuple[bytes, list[dict[str, Any]], list[dict[str, Any]]]:
    """A chain of ``layers`` MatMul+Relu over [batch, width] float32."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(1)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(helper.make_tensor(f"w{i}", f, w.shape, w.ravel()))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        out = "out" if i == layers - 1 else f"r{i}"
        nodes.append(helper.make_node("Relu", [f"m{i}"], [out]))
        prev = out
    vi = helper.make_tensor_value_info
    data = _model(nodes, [vi("x", f, ["batch", width])], [vi("out", f, ["batch", width])], inits)
    spec_in = [{"name": "x", "dtype": "float32", "shape": ["batch", width]}]
    spec_out = [{"name": "out", "dtype": "float32", "shape": ["batch", width]}]
    return data, spec_in, spec_out


def per_call(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(name: str, model: neuropod.NeuropodModel, inputs: dict[str, np.ndarray], calls: int, rounds: int) -> dict[str, float]:
    session = model._handle.session  # the very session neuropod runs
    raw = lambda: session.run(None, inputs)  # noqa: E731
    ours = lambda: model.infer(inputs)  # noqa: E731
    np.testing.assert_array_equal(raw()[0], ours()["out"])
    for _ in range(3):  # warm up both paths
        per_call(raw, calls)
        per_call(ours, calls)
    raws, nps = [], []
    for r in range(rounds):
        first, second = (raw, ours) if r % 2 == 0 else (ours, raw)
        a, b = per_call(first, calls), per_call(second, calls)
        raws.append(a if first is raw else b)
        nps.append(b if first is raw else a)
    raw_med, np_med = statistics.median(raws), statistics.median(nps)
    overhead = statistics.median(n - r for n, r in zip(nps, raws))
    ratio = statistics.median(n / r for n, r in zip(nps, raws))
    print(
        f"{name:<28} raw {raw_med * 1e6:9.2f} us   neuropod {np_med * 1e6:9.2f} us   "
        f"ratio {ratio:6.3f}   overhead {overhead * 1e6:6.2f} us/call   ({rounds} rounds x {calls} calls)"
    )
    return {"raw": raw_med, "neuropod": np_med, "ratio": ratio, "overhead": overhead}


# --- discovery cost, in fresh interpreters -------------------------------------------

_STAND_IN = '''
"""Stand-in for the {platform} plugin, for timing discovery only: it does what a
real plugin's discovery does (metadata lookups of its framework), no more."""
from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

@hookimpl
def supported_versions():
    found = installed_distribution(*{dists!r})
    return [Backend("{platform}", found[1], found[0])] if found else []

@hookimpl
def device_caps(backend):
    return DeviceCaps() if backend.platform == "{platform}" else None
'''

_STAND_INS = {
    "torchscript": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
    "tensorrt": ("tensorrt", "tensorrt-cu12"),
}


def _stand_in_site() -> Path:
    """A directory with three small distributions whose entry points join neuropod-onnx's."""
    site = Path(tempfile.mkdtemp(prefix="neuropod-bench-site-"))
    for platform, dists in _STAND_INS.items():
        if any(ep.name == platform for ep in __import__("importlib_metadata").entry_points(group="neuropod.backends")):
            continue  # the real plugin is installed: time that one
        module = f"bench_standin_{platform}"
        (site / f"{module}.py").write_text(_STAND_IN.format(platform=platform, dists=dists))
        info = site / f"bench_standin_{platform}-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bench-standin-{platform}\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[neuropod.backends]\n{platform} = {module}\n")
    return site


def _in_fresh_python(code: str, env: dict[str, str], runs: int = 9) -> list[str]:
    outs = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.append(out.stdout.strip())
    return outs


def discovery(runs: int) -> None:
    env = dict(os.environ)
    t_import = [
        float(x)
        for x in _in_fresh_python(
            "import time; t=time.perf_counter(); import neuropod; print(time.perf_counter()-t)", env, runs
        )
    ]
    site = _stand_in_site()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    code = textwrap.dedent(
        """
        import sys, time
        t = time.perf_counter()
        import neuropod.plugins as p  # includes `import neuropod`
        bs = p.installed_backends()
        caps = [p.backend_caps(b) for b in bs]
        dt = time.perf_counter() - t
        eps = [ep.name for ep in __import__('importlib_metadata').entry_points(group='neuropod.backends')]
        heavy = [m for m in ('torch', 'tensorflow', 'onnxruntime', 'tensorrt', 'onnx') if m in sys.modules]
        print(dt, ','.join(sorted(eps)), ','.join(heavy) or '-', len(bs))
        """
    )
    rows = [line.split() for line in _in_fresh_python(code, env, runs)]
    t_list = [float(r[0]) for r in rows]
    heavy = {r[2] for r in rows}
    print(f"{'import neuropod':<28} median {statistics.median(t_import) * 1e3:7.2f} ms  ({runs} fresh interpreters)")
    print(
        f"{'list backends + caps':<28} median {statistics.median(t_list) * 1e3:7.2f} ms  "
        f"entry points: {rows[0][1]}; frameworks imported: {', '.join(sorted(heavy))}  (target < 100 ms, none)"
    )
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "neuropod.cli", "backends"], env=env, capture_output=True, check=True)
    print(f"{'`neuropod backends` command':<28} {(time.perf_counter() - t0) * 1e3:7.2f} ms wall, including interpreter start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke test")
    args = ap.parse_args()
    rounds = 7 if args.quick else args.rounds
    import onnxruntime

    print(f"neuropod {neuropod.__version__}, onnxruntime {onnxruntime.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data, spec_in, spec_out, inputs = tiny_model()
        path = create_onnx_neuropod(Path(tmp) / "tiny", "tiny", spec_in, spec_out, onnx_model=data)
        with neuropod.load_neuropod(path) as model:
            tiny = compare("tiny (two 2x2 adds)", model, inputs, calls=2000, rounds=rounds)

        # Calibrate the heavy model's batch to about a millisecond per call.
        layers, batch = 8, 16
        data, spec_in, spec_out = heavy_model(layers)
        path = create_onnx_neuropod(Path(tmp) / "heavy", "heavy", spec_in, spec_out, onnx_model=data)
        with neuropod.load_neuropod(path) as model:
            session = model._handle.session
            while True:
                x = np.random.default_rng(2).standard_normal((batch, 256)).astype(np.float32)
                t = min(per_call(lambda x=x: session.run(None, {"x": x}), 20) for _ in range(3))
                if t >= 0.9e-3 or batch >= 4096:
                    break
                batch = int(batch * max(1.2, min(4.0, 1e-3 / t)))
            heavy = compare(f"~1 ms ({layers}x MatMul, batch {batch})", model, {"x": x}, calls=50, rounds=rounds)
    discovery(runs=5 if args.quick else 9)
    print()
    ok_tiny = tiny["overhead"] <= 3e-6
    ok_heavy = heavy["ratio"] <= 1.02
    print(f"target tiny overhead <= 3 us: {'met' if ok_tiny else 'NOT met'} ({tiny['overhead'] * 1e6:.2f} us)")
    print(f"target ~1 ms ratio <= 1.02:   {'met' if ok_heavy else 'NOT met'} ({heavy['ratio']:.3f})")


if __name__ == "__main__":
    main()
