"""The OIP JSON tensor path in process: neuropod serve's decode and encode against the floor's.

    python bench/bench_codec.py [--repeats 31] [--calls 40] [--case many|tiny|both] [--profile]

No server and no socket: this times, in one process, the work ``neuropod serve``
does on the CPU for a plain JSON inference request (no binary extension),
step by step, beside the same work done the floor's way (bench/serve_floor.py's
:func:`json_inputs` and :func:`json_response`, imported from it, so the floor
measured here is the one the end-to-end benchmark runs):

* ``parse``: :func:`~neuropod_serving.protocol.inference.parse_infer_request` with
  the model's input spec, split into ``body`` (the JSON parse with its bounds
  checks, ``_split``) and ``tensors`` (every input's checks and its array,
  ``_decode_tensors``);
* ``spec``: the model's spec check of those inputs (``SpecValidator.check_inputs``,
  which the model's own ``infer`` runs);
* ``encode``: :func:`~neuropod_serving.protocol.inference.build_infer_response`
  of the model's output as JSON ``data``;
* the floor's ``decode`` (orjson, then one ``np.asarray`` per input) and ``encode``
  (orjson of the first input as the output).

Cases: ``many``, bench_serve.py's 100 float32 inputs of [10, 5] (the original
Neuropod's many-small-tensors model; the output their sum, [10, 5]), and ``tiny``,
two float32 inputs of [1, 2] (the output [1, 2]). The bodies are what the
neuropod client sends (``build_infer_request(binary=False, binary_outputs=False)``).

Each timing is the mean of ``--calls`` calls in a row; the neuropod steps and the
floor's alternate, in the opposite order every other repeat, and the table shows
medians over ``--repeats`` repeats (µs per request) and the ratios of neuropod's
medians to the floor's. ``--profile`` adds cProfile's top functions of neuropod's
parse and encode. Run it with nothing else busy on the machine: it measures one
core's time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_floor
from neuropod.spec import SpecValidator, parse_spec
from neuropod_serving.protocol import bodies, inference
from neuropod_serving.protocol.inference import build_infer_request, build_infer_response, parse_infer_request


class Case:
    """One model's request body, specs and output."""

    def __init__(self, name: str, inputs: dict[str, np.ndarray], output: np.ndarray) -> None:
        self.name = name
        self.body = build_infer_request(inputs, binary=False, binary_outputs=False).content
        in_specs = parse_spec(
            [{"name": n, "dtype": "float32", "shape": list(a.shape)} for n, a in inputs.items()], "inputs"
        )
        out_specs = parse_spec([{"name": "output", "dtype": "float32", "shape": list(output.shape)}], "outputs")
        self.specs = {s.name: s for s in in_specs}
        self.validator = SpecValidator(name, in_specs, out_specs)
        self.outputs = {"output": output}


def cases() -> dict[str, Case]:
    rng = np.random.default_rng(0)
    many = {f"input_{i}": rng.standard_normal((10, 5)).astype(np.float32) for i in range(100)}
    tiny = {"x": rng.standard_normal((1, 2)).astype(np.float32), "y": rng.standard_normal((1, 2)).astype(np.float32)}
    return {
        "many": Case("small_inputs_100", many, np.sum(np.stack(list(many.values())), axis=0, dtype=np.float32)),
        "tiny": Case("tiny", tiny, tiny["x"] + tiny["y"]),
    }


def steps(case: Case) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """Neuropod's steps and the floor's, each a call without arguments."""
    body = case.body
    request = parse_infer_request(body, None, input_spec=case.specs)
    header, _, _ = bodies.split_body(body, None, "request")
    empty = memoryview(b"")
    floor_header, floor_arrays = serve_floor.json_inputs(body)

    def encode() -> bytes:
        outputs = case.outputs
        return build_infer_response(case.name, outputs, binary=request.binary_outputs(outputs), model_version="1",
                                    id=request.id).content  # fmt: skip

    ours = {
        "parse": lambda: parse_infer_request(body, None, input_spec=case.specs),
        "  body": lambda: bodies.split_body(body, None, "request"),
        "  tensors": lambda: inference._decode_tensors(header, "inputs", empty, case.specs, required=True),
        "spec": lambda: case.validator.check_inputs(request.inputs),
        "encode": encode,
    }
    floor = {
        "decode": lambda: serve_floor.json_inputs(body),
        "encode": lambda: serve_floor.json_response(case.name, "output", floor_header, floor_arrays),
    }
    return ours, floor


def timed(fn: Callable[[], Any], calls: int) -> float:
    """µs per call, the mean of ``calls`` calls in a row."""
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def measure(case: Case, repeats: int, calls: int) -> None:
    ours, floor = steps(case)
    samples: dict[str, list[float]] = {f"neuropod {k}": [] for k in ours} | {f"floor {k}": [] for k in floor}
    groups = [("neuropod", ours), ("floor", floor)]
    for r in range(repeats + 1):
        for label, group in groups if r % 2 == 0 else groups[::-1]:
            for key, fn in group.items():
                t = timed(fn, calls)
                if r:  # the first round warms up
                    samples[f"{label} {key}"].append(t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"\n{case.name}: {len(case.body):,}-byte JSON body, medians of {repeats} repeats x {calls} calls (µs per request)"
    )
    for key, value in med.items():
        print(f"  {key:<22} {value:9.1f}")
    ours_total = med["neuropod parse"] + med["neuropod spec"] + med["neuropod encode"]
    floor_total = med["floor decode"] + med["floor encode"]
    print(f"  {'neuropod total':<22} {ours_total:9.1f}   (parse + spec + encode)")
    print(f"  {'floor total':<22} {floor_total:9.1f}   (decode + encode)")
    print(f"  ratios neuropod / floor: decode {med['neuropod parse'] / med['floor decode']:.2f}, "
          f"encode {med['neuropod encode'] / med['floor encode']:.2f}, total {ours_total / floor_total:.2f}")  # fmt: skip


def profile(case: Case, calls: int) -> None:
    ours, _ = steps(case)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        ours["parse"]()
        ours["encode"]()
    profiler.disable()
    print(f"\ncProfile of {calls} parses and encodes of {case.name} (tottime order):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31, help="repeats; medians shown (default 31)")
    parser.add_argument("--calls", type=int, default=40, help="calls per timing (default 40)")
    parser.add_argument("--case", choices=("many", "tiny", "both"), default="both")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    args = parser.parse_args()
    for name, case in cases().items():
        if args.case in (name, "both"):
            measure(case, args.repeats, args.calls)
            if args.profile:
                profile(case, args.calls * 5)


if __name__ == "__main__":
    main()
