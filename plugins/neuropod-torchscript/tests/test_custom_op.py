"""A real custom op, compiled here with g++ against the installed torch, loaded from the package.

The op library is built and the model that calls it is scripted in a
subprocess, so this test process has never seen the op when the package
loads it: only the backend's ``torch.ops.load_library`` can make it work.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import neuropod
from neuropod.errors import BackendError, PackageError
from neuropod.packagers import create_torchscript_neuropod

from conftest import spec

OP_SOURCE = r"""
#include <torch/script.h>

// out = x * scale + 1: arithmetic a test can check independently.
torch::Tensor scale_plus_one(torch::Tensor x, double scale) {
  return x * scale + 1;
}

TORCH_LIBRARY(neuropod_test_ops, m) {
  m.def("scale_plus_one(Tensor x, float scale) -> Tensor", scale_plus_one);
}
"""

BUILD_AND_SCRIPT = r"""
import subprocess, sys, torch
from torch.utils import cpp_extension
src, lib, model = sys.argv[1:4]
abi = int(torch.compiled_with_cxx11_abi())
# C++20: torch 2.14's headers need it (2.13's build with it too).
cmd = ["g++", "-shared", "-fPIC", "-O1", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", src, "-o", lib]
cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
cmd += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-ltorch", "-ltorch_cpu", "-lc10"]
cmd += [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
subprocess.run(cmd, check=True)
torch.ops.load_library(lib)

class UsesOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": torch.ops.neuropod_test_ops.scale_plus_one(x, 3.0)}

torch.jit.save(torch.jit.script(UsesOp()), model)
"""

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the custom op")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("op")
    (work / "op.cpp").write_text(OP_SOURCE)
    (work / "build.py").write_text(textwrap.dedent(BUILD_AND_SCRIPT))
    lib, model = work / "libneuropod_test_ops.so", work / "uses_op.pt"
    subprocess.run([sys.executable, str(work / "build.py"), str(work / "op.cpp"), str(lib), str(model)], check=True)
    return lib, model


def test_custom_op_loaded_from_the_package(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    lib, model = compiled
    assert not hasattr(torch.ops.neuropod_test_ops, "scale_plus_one"), "this process has not loaded the op"
    in_spec, out_spec = spec(("x", "float32", [None])), spec(("y", "float32", [None]))
    x = np.array([0, 1, 2.5], np.float32)

    # Without the library the module cannot even be loaded: the op is unknown.
    with pytest.raises(BackendError, match="neuropod_test_ops"):
        create_torchscript_neuropod(tmp_path / "no_ops", "uses_op", in_spec, out_spec, module_path=model)
    assert not (tmp_path / "no_ops").exists()

    path = create_torchscript_neuropod(
        tmp_path / "ops", "uses_op", in_spec, out_spec, module_path=model, custom_ops=[lib],
        test_input_data={"x": x}, test_expected_out={"y": x * 3 + 1},
    )
    assert (path / "0" / "ops" / lib.name).read_bytes() == lib.read_bytes()
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_allclose(m.infer({"x": x})["y"], x * 3 + 1)
    # A second package with the same library loads it once per process (no double registration).
    again = create_torchscript_neuropod(
        tmp_path / "ops2", "uses_op", in_spec, out_spec, module_path=model, custom_ops=[lib]
    )
    with neuropod.load_neuropod(again) as m:
        np.testing.assert_allclose(m.infer({"x": x})["y"], x * 3 + 1)


def test_custom_op_file_that_fails_to_load(tmp_path: Path) -> None:
    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x}

    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not a shared library")
    scripted = tmp_path / "plain.pt"
    torch.jit.save(torch.jit.script(Plain()), str(scripted))
    with pytest.raises(PackageError, match="custom op library libbogus.so failed to load in torch"):
        create_torchscript_neuropod(
            tmp_path / "p", "plain", spec(("x", "float32", [None])), spec(("y", "float32", [None])),
            module_path=scripted, custom_ops=[bogus],
        )
    assert not (tmp_path / "p").exists()
