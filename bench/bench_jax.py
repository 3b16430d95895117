"""Neuropod's JAX path against calling the jitted exported program directly, in one run.

    python bench/bench_jax.py [--rounds 41] [--quick] [--json PATH]

The raw side is the very jitted program neuropod loaded (``jax.jit`` over
``Exported.call``), called with the same numpy inputs and the parameters
already on the device, its outputs read with ``np.asarray`` (which waits for
the result: JAX calls are asynchronous). The neuropod side is
``model.infer``: spec checks, the call, and outputs copied into the caller's
own writable numpy arrays. For a tiny model (two 2x2 float32 adds) and an
MLP of 8 Linear+ReLU layers 4096 wide at batch 256 (512 MB of weights,
minutes on two cores). Targets: tiny added latency <= 3 us, MLP ratio
<= 1.01. The tiny case also prints where the added time goes: the plugin's
``run`` (the ``infer`` hook) against the raw call, and the core's
``model.infer`` against ``run``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

import neuropod
from _common import add_json_option, compare, compare_per_call, verdict, write_json
from neuropod.packagers import create_jax_neuropod


def two_adds(x: Any, y: Any) -> dict[str, Any]:
    return {"out": x + y + y}


def mlp(params: list[dict[str, Any]], x: Any) -> dict[str, Any]:
    for layer in params:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return {"out": x}


def mlp_params(layers: int, width: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"w": (rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width)), "b": np.zeros(width, np.float32)}
        for _ in range(layers)
    ]


def raw_call(model: Any) -> Any:
    """The jitted program neuropod calls, without neuropod: ``call(*inputs)`` giving the result's leaves."""
    return model._handle._call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a smaller MLP, for a smoke test")
    add_json_option(ap)
    args = ap.parse_args()
    rounds = 7 if args.quick else args.rounds
    print(f"neuropod {neuropod.__version__}, jax {jax.__version__} ({jax.devices()[0].platform}), "
          f"numpy {np.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        spec = [{"name": n, "dtype": "float32", "shape": [2, 2]} for n in ("x", "y")]
        path = create_jax_neuropod(
            Path(tmp) / "tiny", "tiny", spec, [{"name": "out", "dtype": "float32", "shape": [2, 2]}], fn=two_adds
        )
        x, y = (rng.standard_normal((2, 2)).astype(np.float32) for _ in range(2))
        with neuropod.load_neuropod(path) as model:
            call = raw_call(model)
            np.testing.assert_array_equal(np.asarray(call(x, y)[0]), model.infer({"x": x, "y": y})["out"])
            np.testing.assert_allclose(model.infer({"x": x, "y": y})["out"], x + 2 * y, rtol=1e-6)
            tiny = compare_per_call(
                "tiny (two 2x2 adds), raw np.asarray(out)", lambda: np.asarray(call(x, y)[0]),
                lambda: model.infer({"x": x, "y": y}), calls=20000, key="tiny",
            )  # fmt: skip
            compare_per_call(
                "  same, raw also copies (np.array)", lambda: np.array(call(x, y)[0]),
                lambda: model.infer({"x": x, "y": y}), calls=20000,
            )  # fmt: skip
            compare("  same, in rounds", lambda: np.asarray(call(x, y)[0]), lambda: model.infer({"x": x, "y": y}),
                    calls=2000, rounds=rounds)  # fmt: skip
            # Where the added time goes: the plugin's run() (what the infer hook calls) against the raw
            # call, then the core (spec checks of inputs and outputs, dispatch) against run().
            inputs, run = {"x": x, "y": y}, model._handle.run
            compare_per_call("  of which the plugin's run()", lambda: np.asarray(call(x, y)[0]),
                             lambda: run(inputs, None), calls=20000, key="tiny_plugin")  # fmt: skip
            compare_per_call("  of which the core (infer vs run())", lambda: run(inputs, None),
                             lambda: model.infer(inputs), calls=20000, key="tiny_core")  # fmt: skip

        layers, width, batch = (8, 1024, 64) if args.quick else (8, 4096, 256)
        params = mlp_params(layers, width)
        spec = [{"name": "x", "dtype": "float32", "shape": ["batch", width]}]
        path = create_jax_neuropod(
            Path(tmp) / "mlp", "mlp", spec, [{"name": "out", "dtype": "float32", "shape": ["batch", width]}],
            fn=mlp, params=params,
        )  # fmt: skip
        del params
        xb = rng.standard_normal((batch, width)).astype(np.float32)
        with neuropod.load_neuropod(path) as model:
            call = raw_call(model)
            np.testing.assert_array_equal(np.asarray(call(xb)[0]), model.infer({"x": xb})["out"])
            heavy = compare(f"MLP {layers}x{width} (Linear+ReLU), batch {batch}", lambda: np.asarray(call(xb)[0]),
                            lambda: model.infer({"x": xb}), calls=3, rounds=max(5, rounds // 4), key="mlp")  # fmt: skip
    print()
    verdict("tiny added latency <= 3 us", tiny["overhead"] <= 3e-6, f"{tiny['overhead'] * 1e6:.2f} us", key="tiny")
    verdict(f"MLP {layers}x{width} batch {batch} ratio <= 1.01", heavy["ratio"] <= 1.01, f"{heavy['ratio']:.4f}",
            key="mlp")  # fmt: skip
    write_json(args.json, "jax", {"jax": jax.__version__}, mlp={"layers": layers, "width": width, "batch": batch})


if __name__ == "__main__":
    main()
