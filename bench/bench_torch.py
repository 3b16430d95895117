"""Neuropod's torch.export and AOTInductor paths against calling torch directly, in one run; then one
model through every PyTorch format neuropod runs (TorchScript, torch.export, AOTInductor, ONNX).

    python bench/bench_torch.py [--rounds 41] [--quick] [--json PATH]

Raw sides, with tensors made from the same numpy inputs by ``torch.from_numpy``
and outputs read with ``.numpy()``: for ``torch_export`` the very
``ExportedProgram.module()`` neuropod loaded, called as users call it
(``module(x, y)``) and through its ``forward`` (the call neuropod makes: the
same graph and input guards, without nn.Module's hook dispatch); for ``aoti`` the AOTInductor
runner neuropod loaded, called as ``aoti_load_package`` returns it
(``AOTICompiledModel.__call__``) and through its loader's ``run`` (the call
neuropod makes, the fastest way in). The neuropod side is ``model.infer``:
spec checks, conversion in and out, the call.

Cases: a tiny model (two 2x2 float32 adds), where the added latency is the
whole story (target <= 3 us per call, with where the time goes: the
plugin's ``run`` against the raw call, the core's ``infer`` against
``run``); and an MLP of 8 Linear+ReLU layers 4096 wide at batch 256 (512 MB
of weights, seconds per call on two cores), target ratio <= 1.01. The MLP's
AOTInductor compile takes a minute or more. The last table runs the same two
models through each format neuropod offers for PyTorch (TorchScript and ONNX
rows need neuropod-torchscript, and neuropod-onnx with onnx and onnxruntime;
a row says why it is missing otherwise).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

import neuropod
from _common import add_json_option, compare, compare_per_call, per_call, record, verdict, write_json
from neuropod.packagers import create_aoti_neuropod, create_torch_export_neuropod


class TwoAdds(torch.nn.Module):
    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {"out": x + y + y}


class MLP(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
        )

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"out": self.layers(x)}


def _spec(names: list[str], shape: list[Any]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": "float32", "shape": shape} for n in names]


def _onnx_bytes(module: torch.nn.Module, tiny: bool, width: int = 0) -> bytes:
    """The same model as ONNX, written node by node from the module's own weights (no exporter needed)."""
    from onnx import TensorProto, helper, numpy_helper

    if tiny:
        nodes = [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Add", ["s", "y"], ["out"])]
        ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("x", "y")]
        outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 2])]
        inits = []
    else:
        nodes, inits, prev = [], [], "x"
        linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        for i, lin in enumerate(linears):
            w = lin.weight.detach().numpy().T.copy()  # Linear computes x @ W^T + b
            inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(lin.bias.detach().numpy(), f"b{i}")]
            out = "out" if i == len(linears) - 1 else f"h{i}"
            nodes += [helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"g{i}"]), helper.make_node("Relu", [f"g{i}"], [out])]
            prev = out
        ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])]
        outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", width])]
    graph = helper.make_graph(nodes, "bench", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _formats() -> dict[str, tuple[Callable[..., Path] | None, str]]:
    """Format name -> (packager taking (path, name, ins, outs, module, tiny, width, examples), or None and why not)."""
    found: dict[str, tuple[Callable[..., Path] | None, str]] = {}

    def torchscript(path: Path, name: str, ins: Any, outs: Any, module: Any, tiny: bool, width: int, ex: Any) -> Path:
        from neuropod.packagers import create_torchscript_neuropod

        with _quiet():
            scripted = torch.jit.script(module)
        return Path(create_torchscript_neuropod(path, name, ins, outs, module=scripted))

    def exported(path: Path, name: str, ins: Any, outs: Any, module: Any, tiny: bool, width: int, ex: Any) -> Path:
        return Path(create_torch_export_neuropod(path, name, ins, outs, module=module, example_inputs=ex))

    def aoti(path: Path, name: str, ins: Any, outs: Any, module: Any, tiny: bool, width: int, ex: Any) -> Path:
        return Path(create_aoti_neuropod(path, name, ins, outs, module=module, example_inputs=ex))

    def onnx(path: Path, name: str, ins: Any, outs: Any, module: Any, tiny: bool, width: int, ex: Any) -> Path:
        from neuropod.packagers import create_onnx_neuropod

        return Path(create_onnx_neuropod(path, name, ins, outs, onnx_model=_onnx_bytes(module, tiny, width)))

    have = {name: importlib.util.find_spec(name) is not None for name in ("neuropod_torchscript", "neuropod_onnx", "onnx", "onnxruntime")}
    found["TorchScript"] = (torchscript, "") if have["neuropod_torchscript"] else (None, "neuropod-torchscript is not installed")
    found["torch.export"] = (exported, "")
    found["AOTInductor"] = (aoti, "")
    missing = [n for n in ("neuropod_onnx", "onnx", "onnxruntime") if not have[n]]
    found["ONNX (onnxruntime)"] = (onnx, "") if not missing else (None, f"not installed: {', '.join(missing)}")
    return found


class _quiet:
    """Hide torch's TorchScript deprecation notice: this is a benchmark, not a model author's session."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def _median_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    return statistics.median(per_call(fn, calls) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a smaller MLP, for a smoke test")
    add_json_option(ap)
    args = ap.parse_args()
    rounds = 7 if args.quick else args.rounds
    print(f"neuropod {neuropod.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numpy {np.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")  # fmt: skip
    f = torch.from_numpy
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((2, 2)).astype(np.float32) for _ in range(2))
    tiny_in, tiny_out = _spec(["x", "y"], [2, 2]), _spec(["out"], [2, 2])
    layers, width, batch = (8, 1024, 64) if args.quick else (8, 4096, 256)
    mlp_in, mlp_out = _spec(["x"], ["batch", width]), _spec(["out"], ["batch", width])
    xb = rng.standard_normal((batch, width)).astype(np.float32)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        exported = create_torch_export_neuropod(Path(tmp) / "tiny_e", "tiny_e", tiny_in, tiny_out, module=TwoAdds(),
                                                example_inputs={"x": x, "y": y})  # fmt: skip
        with neuropod.load_neuropod(exported) as model:
            module = model._handle.module  # the very ExportedProgram.module() neuropod loaded
            forward = module.forward  # what neuropod calls: the same graph and guards, without the hooks
            inputs, run = {"x": x, "y": y}, model._handle.run
            np.testing.assert_array_equal(module(f(x), f(y))["out"].numpy(), model.infer(inputs)["out"])
            print("\ntorch_export (ExportedProgram.module())")
            compare_per_call("tiny, raw module(x, y)", lambda: module(f(x), f(y))["out"].numpy(),
                             lambda: model.infer(inputs), calls=20000, key="torch_export tiny module")  # fmt: skip
            tiny_e = compare_per_call("tiny, raw module.forward(x, y)", lambda: forward(f(x), f(y))["out"].numpy(),
                                      lambda: model.infer(inputs), calls=20000, key="torch_export tiny")  # fmt: skip
            compare("  same, in rounds", lambda: forward(f(x), f(y))["out"].numpy(), lambda: model.infer(inputs),
                    calls=2000, rounds=rounds)  # fmt: skip
            compare_per_call("  of which the plugin's run()", lambda: forward(f(x), f(y))["out"].numpy(),
                             lambda: run(inputs, None), calls=20000)  # fmt: skip
            compare_per_call("  of which the core (infer vs run())", lambda: run(inputs, None),
                             lambda: model.infer(inputs), calls=20000)  # fmt: skip

        compiled = create_aoti_neuropod(Path(tmp) / "tiny_a", "tiny_a", tiny_in, tiny_out, module=TwoAdds(),
                                        example_inputs={"x": x, "y": y})  # fmt: skip
        with neuropod.load_neuropod(compiled) as model:
            runner = model._handle.program  # what aoti_load_package returns, as neuropod loaded it
            loader_run = runner.loader.run
            inputs, run = {"x": x, "y": y}, model._handle.run
            np.testing.assert_array_equal(runner(f(x), f(y))["out"].numpy(), model.infer(inputs)["out"])
            print("\naoti (AOTInductor runner)")
            compare_per_call("tiny, raw runner(x, y) (AOTICompiledModel)", lambda: runner(f(x), f(y))["out"].numpy(),
                             lambda: model.infer(inputs), calls=20000, key="aoti tiny runner")  # fmt: skip
            tiny_a = compare_per_call("tiny, raw loader.run([x, y])", lambda: loader_run([f(x), f(y)])[0].numpy(),
                                      lambda: model.infer(inputs), calls=20000, key="aoti tiny")  # fmt: skip
            compare("  same, in rounds", lambda: loader_run([f(x), f(y)])[0].numpy(), lambda: model.infer(inputs),
                    calls=2000, rounds=rounds)  # fmt: skip
            compare_per_call("  of which the plugin's run()", lambda: loader_run([f(x), f(y)])[0].numpy(),
                             lambda: run(inputs, None), calls=20000)  # fmt: skip
            compare_per_call("  of which the core (infer vs run())", lambda: run(inputs, None),
                             lambda: model.infer(inputs), calls=20000)  # fmt: skip
        print(f"(tiny packaging, both formats: {time.perf_counter() - t0:.1f} s)")

        print(f"\nMLP {layers}x{width} (Linear+ReLU), batch {batch}")
        mlp = MLP(layers, width).eval()
        heavy: dict[str, dict[str, float]] = {}
        made: dict[str, tuple[Path, float]] = {}  # format -> (MLP package, seconds to make it), reused below
        for label, packager, fmt in (("torch_export", create_torch_export_neuropod, "torch.export"),
                                     ("aoti", create_aoti_neuropod, "AOTInductor")):  # fmt: skip
            t0 = time.perf_counter()
            path = packager(Path(tmp) / f"mlp_{label}", f"mlp_{label}", mlp_in, mlp_out, module=mlp,
                            example_inputs={"x": xb[:2]})  # fmt: skip
            packaged = time.perf_counter() - t0
            made[fmt] = (path, packaged)
            with neuropod.load_neuropod(path) as model:
                handle = model._handle
                if label == "aoti":
                    lrun = handle.program.loader.run
                    raw: Callable[[], Any] = lambda lrun=lrun: lrun([f(xb)])[0].numpy()  # noqa: E731
                else:
                    mod = handle.module

                    def raw(mod: Any = mod) -> Any:
                        with torch.inference_mode():  # its weights require grad, as the module's did
                            return mod(f(xb))["out"].numpy()

                np.testing.assert_allclose(raw(), model.infer({"x": xb})["out"], rtol=1e-4, atol=1e-4)
                heavy[label] = compare(f"  {label} (packaged in {packaged:.0f} s)", raw, lambda: model.infer({"x": xb}),
                                       calls=3, rounds=max(5, rounds // 4), key=f"{label} mlp")  # fmt: skip

        print("\nOne model, every PyTorch format (through neuropod; median per call)")
        print(f"{'format':<20} {'tiny us/call':>13} {f'MLP {width} ms/call':>18} {'MLP package MB':>15} "
              f"{'MLP packaging s':>16} {'MLP load ms':>12}")  # fmt: skip
        for fmt, (packager_fn, why) in _formats().items():
            if packager_fn is None:
                print(f"{fmt:<20} skipped: {why}")
                continue
            slug = fmt.split()[0].replace(".", "_").lower()
            tiny_path = packager_fn(Path(tmp) / f"t_{slug}", f"t_{slug}", tiny_in, tiny_out, TwoAdds(), True, 0,
                                    {"x": x, "y": y})  # fmt: skip
            with neuropod.load_neuropod(tiny_path) as model:
                np.testing.assert_allclose(model.infer({"x": x, "y": y})["out"], x + 2 * y, rtol=1e-6)
                tiny_us = _median_call(lambda model=model: model.infer({"x": x, "y": y}), 5000, 7) * 1e6
            if fmt in made:
                mlp_path, packaging = made[fmt]
            else:
                t0 = time.perf_counter()
                mlp_path = packager_fn(Path(tmp) / f"m_{slug}", f"m_{slug}", mlp_in, mlp_out, mlp, False, width,
                                       {"x": xb[:2]})  # fmt: skip
                packaging = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in Path(mlp_path).rglob("*") if p.is_file()) / 2**20
            t0 = time.perf_counter()
            with neuropod.load_neuropod(mlp_path) as model:
                load_ms = (time.perf_counter() - t0) * 1e3
                with torch.inference_mode():
                    want = mlp(f(xb))["out"].numpy()
                np.testing.assert_allclose(model.infer({"x": xb})["out"], want, rtol=1e-3, atol=1e-3)
                mlp_ms = _median_call(lambda model=model: model.infer({"x": xb}), 2, 5) * 1e3
            results[fmt] = {"tiny": tiny_us, "mlp": mlp_ms}
            record(fmt, f"format {fmt}", tiny_us=tiny_us, mlp_ms=mlp_ms, mlp_package_mb=size, mlp_packaging_s=packaging,
                   mlp_load_ms=load_ms)  # fmt: skip
            print(f"{fmt:<20} {tiny_us:>13.1f} {mlp_ms:>18.1f} {size:>15.0f} {packaging:>16.1f} {load_ms:>12.0f}")
    print()
    verdict("torch_export tiny added latency <= 3 us (vs module.forward)", tiny_e["overhead"] <= 3e-6,
            f"{tiny_e['overhead'] * 1e6:.2f} us", key="torch_export tiny")  # fmt: skip
    verdict("aoti tiny added latency <= 3 us (vs loader.run)", tiny_a["overhead"] <= 3e-6,
            f"{tiny_a['overhead'] * 1e6:.2f} us", key="aoti tiny")  # fmt: skip
    for label, res in heavy.items():
        verdict(f"{label} MLP {layers}x{width} batch {batch} ratio <= 1.01", res["ratio"] <= 1.01, f"{res['ratio']:.4f}",
                key=f"{label} mlp")  # fmt: skip
    write_json(args.json, "torch", {"torch": torch.__version__, "torch_threads": str(torch.get_num_threads())},
               mlp={"layers": layers, "width": width, "batch": batch})  # fmt: skip


if __name__ == "__main__":
    main()
