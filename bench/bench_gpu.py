"""Neuropod on a GPU against the framework called directly, in one run (issue 17's targets).

    python bench/bench_gpu.py [--calls 2000] [--quick] [--only onnx|torchscript]

Needs a GPU, and for each backend its GPU build: torch with CUDA (TorchScript;
also what makes the GPU tensors), onnxruntime-gpu (ONNX). What is missing is
said and skipped; without a GPU the script says so and exits 0 (``nox -s bench``
runs it everywhere).

For each backend, each case alternates a direct call and a neuropod call of
the same loaded session/module, call by call, and prints the medians and the
median added time (``_common.compare_per_call``); GPU work is waited for on
both sides (``torch.cuda.synchronize()``), so the figures are end to end.

1. tiny model, numpy in and out (the framework copies to and from the GPU
   itself on the direct side too): target <= 5 us added per call;
2. an 8-layer 4096-wide float32 MLP at batch 256, numpy in and out: target
   ratio <= 1.01;
3. a 1200x1920x3 uint8 image already on the GPU through a small model (to
   float, scale, a 3x3 colour mix): neuropod with device inputs and outputs
   (``output_device="cuda"``) against the direct call with device tensors
   (target: within 10 us), and neuropod with numpy in and out (the trip
   through host memory that device tensors save; the saving is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import neuropod
from _common import compare_per_call, verdict
from neuropod.devices import local_host

TINY_US = 5.0
MLP_RATIO = 1.01
IMAGE_US = 10.0
H, W = 1200, 1920
#: load_neuropod's keywords: none on a GPU host; device="cpu" for --cpu-check.
LOAD: dict[str, Any] = {}


try:  # the models TorchScript compiles live at module level: it reads their source and annotations
    import torch
    from torch import Tensor
except ImportError:  # no torch: the TorchScript cases are skipped
    torch = None  # type: ignore[assignment]

if torch is not None:

    class Tiny(torch.nn.Module):
        def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
            return {"out": x + y + y}

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU()) for _ in range(8)])

        def forward(self, x: Tensor) -> dict[str, Tensor]:
            return {"out": self.layers(x)}

    class Image(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Parameter(torch.from_numpy(_mix()), requires_grad=False)

        def forward(self, image: Tensor) -> dict[str, Tensor]:
            return {"out": (image.float() / 255.0) @ self.mix}



def _torch() -> Any:
    return torch if torch is not None and torch.cuda.is_available() else None


def _mix() -> np.ndarray:
    return np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]], np.float32)


def bench_torchscript(tmp: Path, calls: int) -> None:
    from neuropod.packagers import create_torchscript_neuropod

    f32 = [{"name": n, "dtype": "float32", "shape": [2, 2]} for n in ("x", "y")]
    tiny = create_torchscript_neuropod(tmp / "ts_tiny", "tiny", f32, [{"name": "out", "dtype": "float32", "shape": [2, 2]}],
                                       module=torch.jit.script(Tiny()))  # fmt: skip
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((2, 2)).astype(np.float32) for _ in range(2))
    with neuropod.load_neuropod(tiny, **LOAD) as model:
        dev = torch.device(model.device)
        fwd = model._handle.module.forward  # the very module neuropod loaded

        def raw() -> Any:
            return fwd(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev))["out"].cpu().numpy()

        np.testing.assert_allclose(model.infer({"x": x, "y": y})["out"], raw(), rtol=1e-6)
        r = compare_per_call(f"torchscript tiny on {model.device}, numpy in/out", raw, lambda: model.infer({"x": x, "y": y}), calls)
        verdict(f"torchscript tiny <= {TINY_US} us added", r["overhead"] * 1e6 <= TINY_US, f"{r['overhead'] * 1e6:.2f} us")
        # Where the added time goes: the plugin's own run (inputs to the GPU, the inference-mode guard,
        # outputs back) without the core's checks.
        run = model._handle.run
        compare_per_call("torchscript tiny: the plugin's run alone", raw, lambda: run({"x": x, "y": y}, None), calls)

    spec = [{"name": "x", "dtype": "float32", "shape": ["batch", 4096]}]
    mlp = create_torchscript_neuropod(tmp / "ts_mlp", "mlp", spec, [{"name": "out", "dtype": "float32", "shape": ["batch", 4096]}],
                                      module=torch.jit.script(MLP()))  # fmt: skip
    batch = rng.standard_normal((256, 4096)).astype(np.float32)
    with neuropod.load_neuropod(mlp, **LOAD) as model:
        fwd = model._handle.module.forward
        dev = torch.device(model.device)

        def raw_mlp() -> Any:
            with torch.inference_mode():
                return fwd(torch.from_numpy(batch).to(dev))["out"].cpu().numpy()

        r = compare_per_call("torchscript MLP 8x4096, batch 256, numpy", raw_mlp, lambda: model.infer({"x": batch}), max(calls // 20, 50))
        verdict(f"torchscript MLP ratio <= {MLP_RATIO}", r["ratio"] <= MLP_RATIO, f"{r['ratio']:.4f}")

    spec = [{"name": "image", "dtype": "uint8", "shape": [H, W, 3]}]
    image = create_torchscript_neuropod(tmp / "ts_image", "image", spec, [{"name": "out", "dtype": "float32", "shape": [H, W, 3]}],
                                        module=torch.jit.script(Image()))  # fmt: skip
    host = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    with neuropod.load_neuropod(image, **LOAD) as model:
        if model.device == "cpu":
            print("torchscript image: device cases skipped on the cpu")
            return
        fwd = model._handle.module.forward
        on_gpu = torch.from_numpy(host).to(model.device)

        def raw_device() -> Any:
            with torch.inference_mode():
                out = fwd(on_gpu)["out"]
            torch.cuda.synchronize()
            return out

        def ours_device() -> Any:
            out = model.infer({"image": on_gpu}, output_device="cuda")["out"]
            torch.cuda.synchronize()
            return out

        np.testing.assert_allclose(ours_device().cpu().numpy(), raw_device().cpu().numpy(), rtol=1e-6)
        _image_cases("torchscript", raw_device, ours_device, lambda: model.infer({"image": host}), max(calls // 10, 100))


def bench_onnx(tmp: Path, calls: int) -> None:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from neuropod.packagers import create_onnx_neuropod

    if "CUDAExecutionProvider" not in ort.get_available_providers() and not LOAD:
        print(f"onnx: skipped: onnxruntime {ort.__version__} has no CUDA provider (pip install 'neuropod-onnx[gpu]')")
        return

    def graph(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any]) -> Any:
        g = helper.make_graph(nodes, "g", inputs, outputs, inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # onnxruntime >= 1.15 reads 8

    def vi(name: str, elem: int, shape: list[Any]) -> Any:
        return helper.make_tensor_value_info(name, elem, shape)

    rng = np.random.default_rng(0)
    f = TensorProto.FLOAT
    tiny = graph([helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Add", ["s", "y"], ["out"])],
                 [vi("x", f, [2, 2]), vi("y", f, [2, 2])], [vi("out", f, [2, 2])], [])  # fmt: skip
    f32 = [{"name": n, "dtype": "float32", "shape": [2, 2]} for n in ("x", "y")]
    path = create_onnx_neuropod(tmp / "ox_tiny", "tiny", f32, [{"name": "out", "dtype": "float32", "shape": [2, 2]}], onnx_model=tiny)
    x, y = (rng.standard_normal((2, 2)).astype(np.float32) for _ in range(2))
    with neuropod.load_neuropod(path, **LOAD) as model:
        sess = model._handle.session  # the very session neuropod created
        assert sess.get_providers()[0] == ("CPUExecutionProvider" if LOAD else "CUDAExecutionProvider")
        run = sess.run
        r = compare_per_call(f"onnx tiny on {model.device}, numpy in/out", lambda: run(["out"], {"x": x, "y": y}),
                             lambda: model.infer({"x": x, "y": y}), calls)  # fmt: skip
        verdict(f"onnx tiny <= {TINY_US} us added", r["overhead"] * 1e6 <= TINY_US, f"{r['overhead'] * 1e6:.2f} us")

    nodes, inits, prev = [], [], "x"
    for i in range(8):
        inits += [numpy_helper.from_array((rng.standard_normal((4096, 4096)) / 64).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(np.zeros(4096, np.float32), f"b{i}")]  # fmt: skip
        nodes += [helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"g{i}"]), helper.make_node("Relu", [f"g{i}"], [f"r{i}" if i < 7 else "out"])]
        prev = f"r{i}"
    mlp = graph(nodes, [vi("x", f, ["batch", 4096])], [vi("out", f, ["batch", 4096])], inits)
    spec = [{"name": "x", "dtype": "float32", "shape": ["batch", 4096]}]
    path = create_onnx_neuropod(tmp / "ox_mlp", "mlp", spec, [{"name": "out", "dtype": "float32", "shape": ["batch", 4096]}], onnx_model=mlp)
    batch = rng.standard_normal((256, 4096)).astype(np.float32)
    with neuropod.load_neuropod(path, **LOAD) as model:
        run = model._handle.session.run
        r = compare_per_call("onnx MLP 8x4096, batch 256, numpy", lambda: run(["out"], {"x": batch}),
                             lambda: model.infer({"x": batch}), max(calls // 20, 50))  # fmt: skip
        verdict(f"onnx MLP ratio <= {MLP_RATIO}", r["ratio"] <= MLP_RATIO, f"{r['ratio']:.4f}")

    u8 = TensorProto.UINT8
    img = graph(
        [helper.make_node("Cast", ["image"], ["f"], to=f), helper.make_node("Div", ["f", "k"], ["n"]),
         helper.make_node("MatMul", ["n", "mix"], ["out"])],
        [vi("image", u8, [H, W, 3])], [vi("out", f, [H, W, 3])],
        [numpy_helper.from_array(np.array(255.0, np.float32), "k"), numpy_helper.from_array(_mix(), "mix")],
    )  # fmt: skip
    spec = [{"name": "image", "dtype": "uint8", "shape": [H, W, 3]}]
    path = create_onnx_neuropod(tmp / "ox_image", "image", spec, [{"name": "out", "dtype": "float32", "shape": [H, W, 3]}], onnx_model=img)
    host = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    with neuropod.load_neuropod(path, **LOAD) as model:
        if model.device == "cpu":
            print("onnx image: device cases skipped on the cpu")
            return
        sess = model._handle.session
        index = int(model.device.split(":")[1])
        on_gpu = ort.OrtValue.ortvalue_from_numpy(host, "cuda", index)  # an image already on the GPU

        def raw_device() -> Any:
            binding = sess.io_binding()
            binding.bind_ortvalue_input("image", on_gpu)
            binding.bind_output("out", "cuda", index)
            sess.run_with_iobinding(binding)
            binding.synchronize_outputs()
            return binding.get_outputs()[0]

        def ours_device() -> Any:
            return model.infer({"image": on_gpu}, output_device="cuda")["out"]

        np.testing.assert_allclose(ours_device().numpy(), raw_device().numpy(), rtol=1e-6)
        _image_cases("onnx", raw_device, ours_device, lambda: model.infer({"image": host}), max(calls // 10, 100))


def _image_cases(name: str, raw_device: Callable[[], Any], ours_device: Callable[[], Any], ours_numpy: Callable[[], Any],
                 calls: int) -> None:  # fmt: skip
    r = compare_per_call(f"{name} {H}x{W}x3 uint8 image, device in/out", raw_device, ours_device, calls)
    verdict(f"{name} device-tensor call within {IMAGE_US} us of the direct call", r["overhead"] * 1e6 <= IMAGE_US,
            f"{r['overhead'] * 1e6:.2f} us")  # fmt: skip
    n = compare_per_call(f"{name} same image: device in/out vs numpy in/out", ours_device, ours_numpy, calls)
    print(f"{name}: device tensors save {n['overhead'] * 1e6:.0f} us per call over numpy in/out "
          f"({n['neuropod'] * 1e6:.0f} us with numpy, {n['raw'] * 1e6:.0f} us on the device; x{n['ratio']:.1f})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="alternating call pairs for the tiny models")
    ap.add_argument("--quick", action="store_true", help="fewer calls, for a smoke test")
    ap.add_argument("--only", choices=("onnx", "torchscript"))
    ap.add_argument("--cpu-check", action="store_true",
                    help="run the numpy cases on the cpu (no targets apply): checks this script where no GPU is")
    args = ap.parse_args()
    calls = 200 if args.quick else args.calls
    host = local_host()
    if args.cpu_check:
        LOAD["device"] = "cpu"
    elif not host.has_gpu:
        print(f"bench_gpu: skipped: no GPU here ({host.note})")
        return
    cuda_torch = torch if args.cpu_check else _torch()
    gpus = "; ".join(f"{g.device} {g.name} (cc {g.compute_capability})" for g in host.gpus)
    print(f"neuropod {neuropod.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {gpus}; "
          f"driver {host.driver_version} (CUDA {host.cuda_driver_version}); "
          f"torch {cuda_torch.__version__ if cuda_torch is not None else 'without CUDA'}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        if args.only in (None, "torchscript"):
            if cuda_torch is None:
                print("torchscript: skipped: needs torch with CUDA")
            else:
                bench_torchscript(Path(tmp), calls)
        if args.only in (None, "onnx"):
            try:
                import onnxruntime as ort

                print(f"onnxruntime {ort.__version__}")
            except ImportError:
                print("onnx: skipped: onnxruntime is not installed")
            else:
                bench_onnx(Path(tmp), calls)


if __name__ == "__main__":
    main()
