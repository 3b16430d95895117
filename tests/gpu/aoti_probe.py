"""Does this machine's torch load an AOTInductor package by itself? Tells a crash in torch from one of ours.

    python tests/gpu/aoti_probe.py [DIR]

Compiles a small Linear for the CPU (and for the GPU when there is one) with
torch alone, then loads and runs each package in a fresh process three ways:
torch's ``aoti_load_package``; ``load_package`` with the arguments neuropod-torch
passes; ``neuropod.load_neuropod`` of a package made from the same ``.pt2``.
Each step prints its exit status (-11 is a segmentation fault); exit 1 if any failed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

STEP = textwrap.dedent(
    """
    import faulthandler, sys
    import torch
    faulthandler.enable()
    how, path, dev = sys.argv[1:4]
    x = torch.randn(2, 4, device=dev)
    if how == "compile":
        torch.manual_seed(0)
        program = torch.export.export(torch.nn.Linear(4, 3).to(dev).eval(), (x,))
        torch._inductor.aoti_compile_and_package(program, package_path=path)
    elif how == "torch":
        print(torch._inductor.aoti_load_package(path)(x).shape)
    elif how == "neuropod_args":
        from torch._inductor.package.package import load_package
        runner = load_package(path, model_name="model", run_single_threaded=False, num_runners=1,
                              device_index=-1 if dev == "cpu" else 0)
        print(runner.loader.run([x])[0].shape)
    else:
        import numpy as np
        import neuropod
        from neuropod.packagers import create_aoti_neuropod
        spec = [{"name": "x", "dtype": "float32", "shape": [2, 4]}]
        out = [{"name": "out", "dtype": "float32", "shape": [2, 3]}]
        pkg = create_aoti_neuropod(path + ".neuropod", "probe", spec, out, compiled_package=path, package_as_zip=False)
        with neuropod.load_neuropod(pkg, device=dev if dev == "cpu" else "cuda:0") as model:
            print(model.infer({"x": np.ones((2, 4), np.float32)})["out"].shape)
    """
)


def main() -> int:
    import torch

    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="aoti-probe-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, cxx11 ABI {torch._C._GLIBCXX_USE_CXX11_ABI}, cuda {torch.cuda.is_available()}")
    failed = False
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        path = str(root / f"{dev}.pt2")
        for how in ("compile", "torch", "neuropod_args", "neuropod"):
            try:
                done = subprocess.run([sys.executable, "-c", STEP, how, path, dev], capture_output=True, text=True,
                                      timeout=240)  # fmt: skip
                rc, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-12:]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", []
            print(f"{dev} {how}: rc={rc}")
            if rc != 0:
                failed = True
                print("    " + "\n    ".join(tail))
                if how == "compile":
                    break
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
