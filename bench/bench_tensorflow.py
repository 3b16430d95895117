"""Neuropod's TensorFlow path against the loaded session called directly, in one run.

    python bench/bench_tensorflow.py [--rounds 41] [--quick] [--json PATH]

On the original Neuropod's own packages (read from ../shared/fixtures):
``tf_addition_model`` (tiny: x + y on 2x2 float32) and
``dummy_object_detection`` (a 1200x1920x3 uint8 image in, two small outputs).
The raw side uses the very session neuropod loaded, three ways:
``Session.run`` with a feed dict (what code calling a session directly
writes; the targets use it), ``Session.make_callable`` (TensorFlow's faster
public way), and the very callable neuropod itself calls, which runs the
graph on the calling thread instead of TensorFlow's inter-op pool (so that
line is neuropod's own overhead: spec checks and bookkeeping). Targets (issue 4): ratio <= 1.05 on the tiny model,
<= 1.02 on object detection.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

import neuropod
from _common import add_json_option, compare, verdict, write_json

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "uber-neuropod-0.3"


def bench_package(
    name: str, package: str, inputs: dict[str, np.ndarray], calls: int, rounds: int, key: str
) -> dict[str, float]:
    with neuropod.load_neuropod(FIXTURES / package) as model:
        handle = model._handle  # the very session neuropod runs
        mapping = json.loads((FIXTURES / package / "0" / "config.json").read_text())["node_name_mapping"]
        outputs = [s.name for s in model.outputs]
        model.infer(inputs)  # makes neuropod's callable for these inputs and outputs
        own = handle._callables[(tuple(inputs), tuple(outputs))]
        values = list(inputs.values())
        feed_dict = {mapping[n] if ":" in mapping[n] else mapping[n] + ":0": v for n, v in inputs.items()}
        fetch_names = [mapping[n] if ":" in mapping[n] else mapping[n] + ":0" for n in outputs]
        pool_callable = handle.session.make_callable(fetch_names, feed_list=list(feed_dict))
        ours = lambda: model.infer(inputs)  # noqa: E731
        direct = compare(f"{name} vs Session.run", lambda: handle.session.run(fetch_names, feed_dict), ours, calls, rounds,
                         key=key)  # fmt: skip
        compare(f"{name} vs make_callable", lambda: pool_callable(*values), ours, calls, rounds, key=f"{key}_callable")
        compare(f"{name} vs neuropod's own callable", lambda: own(*values), ours, calls, rounds, key=f"{key}_own")
        return direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke test")
    add_json_option(ap)
    args = ap.parse_args()
    rounds = 7 if args.quick else args.rounds
    if not FIXTURES.is_dir():
        sys.exit(f"the original Neuropod packages are not at {FIXTURES}")
    from neuropod_tensorflow._quiet import import_tensorflow

    tf = import_tensorflow()
    print(f"neuropod {neuropod.__version__}, tensorflow {tf.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    xy = {"x": np.array([[1, 2], [3, 4]], np.float32), "y": np.array([[7, 8], [9, 10]], np.float32)}
    tiny = bench_package("tiny addition", "tf_addition_model", xy, calls=1000, rounds=rounds, key="tiny")
    image = {"image": np.random.default_rng(0).integers(0, 255, (1200, 1920, 3), dtype=np.uint8)}
    detection = bench_package("object detection", "dummy_object_detection", image, calls=10, rounds=rounds,
                              key="detection")
    print()
    verdict("tiny ratio <= 1.05", tiny["ratio"] <= 1.05, f"{tiny['ratio']:.3f}", key="tiny")
    verdict("object detection ratio <= 1.02", detection["ratio"] <= 1.02, f"{detection['ratio']:.3f}", key="detection")
    write_json(args.json, "tensorflow", {"tensorflow": tf.__version__})


if __name__ == "__main__":
    main()
