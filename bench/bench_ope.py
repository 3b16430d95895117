"""Out-of-process execution: the latency a worker adds, against the same model in-process.

    python bench/bench_ope.py [--rounds 31] [--quick] [--json PATH]

Cases (the original Neuropod's OPE benchmark cases, as ONNX models of the
same shapes so that only onnxruntime is needed):

* tiny: two 2x2 float32 inputs, one add;
* 100 small inputs: 100 float32 inputs of 10x5 summed (dummy_small_input_model's shapes);
* a 1200x1920x3 uint8 image (dummy_object_detection's input, 6.9 MB) through
  the zero-copy input path (``model.empty``), and through the copying path
  for comparison;

plus worker start and model load time. Latency is measured call by call,
alternating in-process and worker calls, and the added latency is the median
of the per-pair differences (see ``_common.compare_per_call``). Targets
(issue 6): added latency <= 50 us (tiny), <= 100 us (100 inputs), <= 100 us
(image, zero-copy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

import neuropod
from _common import add_json_option, compare_per_call, record, verdict, write_json
from neuropod.packagers import create_onnx_neuropod


def _onnx(nodes, inputs, outputs):  # type: ignore[no-untyped-def]
    model = helper.make_model(helper.make_graph(nodes, "bench", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def build(tmp: Path) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    vi, f = helper.make_tensor_value_info, TensorProto.FLOAT
    cases = {}
    spec2 = [{"name": n, "dtype": "float32", "shape": [2, 2]} for n in ("x", "y")]
    tiny = _onnx([helper.make_node("Add", ["x", "y"], ["out"])], [vi("x", f, [2, 2]), vi("y", f, [2, 2])], [vi("out", f, [2, 2])])
    path = create_onnx_neuropod(tmp / "tiny", "tiny", spec2, [{"name": "out", "dtype": "float32", "shape": [2, 2]}], onnx_model=tiny)
    rng = np.random.default_rng(0)
    cases["tiny"] = (path, {n: rng.standard_normal((2, 2)).astype(np.float32) for n in ("x", "y")})
    names = [f"small_input{i}" for i in range(100)]
    many = _onnx([helper.make_node("Sum", names, ["output"])], [vi(n, f, [10, 5]) for n in names], [vi("output", f, [10, 5])])
    path = create_onnx_neuropod(
        tmp / "many", "many", [{"name": n, "dtype": "float32", "shape": [10, 5]} for n in names],
        [{"name": "output", "dtype": "float32", "shape": [10, 5]}], onnx_model=many,
    )
    cases["100 small inputs"] = (path, {n: rng.standard_normal((10, 5)).astype(np.float32) for n in names})
    image = _onnx([helper.make_node("Shape", ["image"], ["shape"])], [vi("image", TensorProto.UINT8, [1200, 1920, 3])],
                  [vi("shape", TensorProto.INT64, [3])])  # fmt: skip
    path = create_onnx_neuropod(
        tmp / "image", "image", [{"name": "image", "dtype": "uint8", "shape": [1200, 1920, 3]}],
        [{"name": "shape", "dtype": "int64", "shape": [3]}], onnx_model=image,
    )
    cases["image 1200x1920x3 uint8"] = (path, {"image": rng.integers(0, 255, (1200, 1920, 3), dtype=np.uint8)})
    return cases


def measure(name: str, path: Path, inputs: dict[str, np.ndarray], rounds: int) -> dict[str, float]:
    """Added latency of one case: the same model in-process and in a worker, interleaved."""
    calls = rounds * (100 if "image" in name else 1000)
    with neuropod.load_neuropod(path) as local, neuropod.load_neuropod(path, use_ope=True) as remote:
        if "image" not in name:
            return compare_per_call(name, lambda: local.infer(inputs), lambda: remote.infer(inputs), calls, key=name)
        shared = remote.empty("image", inputs["image"].shape)
        shared[...] = inputs["image"]
        result = compare_per_call(f"{name}, zero-copy input", lambda: local.infer(inputs),
                                  lambda: remote.infer({"image": shared}), calls, key="image zero-copy")  # fmt: skip
        compare_per_call(f"{name}, copied input", lambda: local.infer(inputs), lambda: remote.infer(inputs), calls,
                         key="image copied")  # fmt: skip
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="thousands of alternating call pairs per case")
    ap.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke test")
    add_json_option(ap)
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    import onnxruntime

    print(f"neuropod {neuropod.__version__}, onnxruntime {onnxruntime.__version__}, Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = build(Path(tmp))
        starts = []
        for _ in range(5 if not args.quick else 2):
            t0 = time.perf_counter()
            model = neuropod.load_neuropod(cases["tiny"][0], use_ope=True)
            starts.append(time.perf_counter() - t0)
            model.close()
        print(f"{'worker start + model load':<44} median {statistics.median(starts) * 1e3:7.1f} ms "
              f"(python -m neuropod.ope.worker, plugins, onnxruntime import, session)")  # fmt: skip
        record("worker start + model load", "start", seconds=statistics.median(starts), runs=len(starts))
        for name, (path, inputs) in cases.items():
            results[name] = measure(name, path, inputs, rounds)
    print()
    for name, limit in (("tiny", 50e-6), ("100 small inputs", 100e-6), ("image 1200x1920x3 uint8", 100e-6)):
        added = results[name]["overhead"]
        verdict(f"{name} added latency <= {limit * 1e6:.0f} us", added <= limit, f"{added * 1e6:.1f} us", key=name)
    write_json(args.json, "ope", {"onnxruntime": onnxruntime.__version__})


if __name__ == "__main__":
    main()
