"""Neuropod's ONNX path against onnxruntime called directly, in one run.

    python bench/bench_onnx.py [--rounds 41] [--quick] [--json PATH]

Prints, for a tiny model (two 2x2 float32 adds) and for a model calibrated
to take about a millisecond:

* the median per-call time of ``InferenceSession.run`` on the very session
  neuropod loaded, the median per-call time of ``model.infer``, their ratio,
  and the median per-round overhead in microseconds. Neuropod calls the
  session's C++ ``run`` itself, past ``InferenceSession.run``'s Python checks
  of the feed (its spec check covers them), so a second tiny line compares
  against that C++ call: neuropod's own work alone.

Calls are interleaved in rounds (see ``_common.compare``). Targets (issue 2):
tiny overhead <= 3 us, 1 ms model ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper

import neuropod
from _common import add_json_option, compare, per_call, verdict, write_json
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


def compare_session(
    name: str, model: neuropod.NeuropodModel, inputs: dict[str, np.ndarray], calls: int, rounds: int, key: str
) -> dict[str, float]:
    session = model._handle.session  # the very session neuropod runs
    raw = lambda: session.run(None, inputs)  # noqa: E731
    ours = lambda: model.infer(inputs)  # noqa: E731
    np.testing.assert_array_equal(raw()[0], ours()["out"])
    return compare(name, raw, ours, calls, rounds, key=key)


def compare_inner(
    name: str, model: neuropod.NeuropodModel, inputs: dict[str, np.ndarray], calls: int, rounds: int, key: str
) -> dict[str, float]:
    """Against the session's C++ run, which neuropod calls past InferenceSession.run's Python checks (its
    spec check covers them): what neuropod's own work costs."""
    session = model._handle.session
    inner, names = session._sess, [o.name for o in session.get_outputs()]
    return compare(name, lambda: inner.run(names, inputs, None), lambda: model.infer(inputs), calls, rounds, key=key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke test")
    add_json_option(ap)
    args = ap.parse_args()
    rounds = 7 if args.quick else args.rounds
    import onnxruntime

    print(f"neuropod {neuropod.__version__}, onnxruntime {onnxruntime.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data, spec_in, spec_out, inputs = tiny_model()
        path = create_onnx_neuropod(Path(tmp) / "tiny", "tiny", spec_in, spec_out, onnx_model=data)
        with neuropod.load_neuropod(path) as model:
            tiny = compare_session("tiny (two 2x2 adds)", model, inputs, calls=2000, rounds=rounds, key="tiny")
            compare_inner("tiny, against the C++ run", model, inputs, calls=2000, rounds=rounds, key="tiny_inner")

        # Calibrate the heavy model's batch to about a millisecond per call.
        layers, batch = 8, 16
        data, spec_in, spec_out = heavy_model(layers)
        path = create_onnx_neuropod(Path(tmp) / "heavy", "heavy", spec_in, spec_out, onnx_model=data)
        with neuropod.load_neuropod(path) as model:
            session = model._handle.session
            while True:
                x = np.random.default_rng(2).standard_normal((batch, 256)).astype(np.float32)
                t = min(per_call(lambda x=x: session.run(None, {"x": x}), 20) for _ in range(3))  # type: ignore[misc]
                if t >= 0.9e-3 or batch >= 4096:
                    break
                batch = int(batch * max(1.2, min(4.0, 1e-3 / t)))
            heavy = compare_session(f"~1 ms ({layers}x MatMul, batch {batch})", model, {"x": x}, calls=50, rounds=rounds,
                                   key="1ms")
    print()
    verdict("tiny overhead <= 3 us", tiny["overhead"] <= 3e-6, f"{tiny['overhead'] * 1e6:.2f} us", key="tiny")
    verdict("~1 ms ratio <= 1.02", heavy["ratio"] <= 1.02, f"{heavy['ratio']:.3f}", key="1ms")
    write_json(args.json, "onnx", {"onnxruntime": onnxruntime.__version__})


if __name__ == "__main__":
    main()
