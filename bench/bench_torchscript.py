"""Neuropod's TorchScript path against calling the scripted module directly, in one run.

    python bench/bench_torchscript.py [--rounds 41] [--quick] [--json PATH]

The raw side calls the very module neuropod loaded, with tensors made from
the same numpy inputs by ``torch.from_numpy``; the neuropod side is
``model.infer`` (spec checks, conversion in and out, inference mode). For a
tiny model (two 2x2 float32 adds) and an MLP calibrated to about a
millisecond. Targets (issue 3): tiny overhead <= 5 us, 1 ms ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

import neuropod
from _common import add_json_option, compare, per_call, verdict, write_json
from neuropod.packagers import create_torchscript_neuropod


class TwoAdds(torch.nn.Module):
    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {"out": x + y + y}


class MLP(torch.nn.Module):
    def __init__(self, layers: int = 8, width: int = 256) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)])

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"out": self.layers(x)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke test")
    add_json_option(ap)
    args = ap.parse_args()
    rounds = 7 if args.quick else args.rounds
    print(f"neuropod {neuropod.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numpy {np.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    f = torch.from_numpy
    with tempfile.TemporaryDirectory() as tmp:
        spec = [{"name": n, "dtype": "float32", "shape": [2, 2]} for n in ("x", "y")]
        path = create_torchscript_neuropod(
            Path(tmp) / "tiny", "tiny", spec, [{"name": "out", "dtype": "float32", "shape": [2, 2]}],
            module=torch.jit.script(TwoAdds()),
        )
        rng = np.random.default_rng(0)
        x, y = (rng.standard_normal((2, 2)).astype(np.float32) for _ in range(2))
        with neuropod.load_neuropod(path) as model:
            module = model._handle.module  # the very module neuropod runs
            np.testing.assert_array_equal(module(f(x), f(y))["out"].numpy(), model.infer({"x": x, "y": y})["out"])
            tiny = compare("tiny (two 2x2 adds)", lambda: module(f(x), f(y)), lambda: model.infer({"x": x, "y": y}),
                           calls=2000, rounds=rounds, key="tiny")  # fmt: skip
            compare("  same, raw also takes .numpy()", lambda: module(f(x), f(y))["out"].numpy(),
                    lambda: model.infer({"x": x, "y": y}), calls=2000, rounds=rounds)  # fmt: skip

        spec = [{"name": "x", "dtype": "float32", "shape": ["batch", 256]}]
        path = create_torchscript_neuropod(
            Path(tmp) / "mlp", "mlp", spec, [{"name": "out", "dtype": "float32", "shape": ["batch", 256]}],
            module=torch.jit.script(MLP()),
        )
        with neuropod.load_neuropod(path) as model:
            module = model._handle.module
            batch = 16
            while True:
                xb = rng.standard_normal((batch, 256)).astype(np.float32)
                t = min(per_call(lambda xb=xb: module(f(xb)), 20) for _ in range(3))  # type: ignore[misc]
                if t >= 0.9e-3 or batch >= 8192:
                    break
                batch = int(batch * max(1.2, min(4.0, 1e-3 / t)))
            heavy = compare(f"~1 ms (8x Linear+ReLU, batch {batch})", lambda: module(f(xb)),
                            lambda: model.infer({"x": xb}), calls=50, rounds=rounds, key="1ms")  # fmt: skip
    print()
    verdict("tiny overhead <= 5 us", tiny["overhead"] <= 5e-6, f"{tiny['overhead'] * 1e6:.2f} us", key="tiny")
    verdict("~1 ms ratio <= 1.02", heavy["ratio"] <= 1.02, f"{heavy['ratio']:.3f}", key="1ms")
    write_json(args.json, "torchscript", {"torch": torch.__version__, "torch_threads": str(torch.get_num_threads())})


if __name__ == "__main__":
    main()
