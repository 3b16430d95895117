"""A custom-op library in C++ (``TORCH_LIBRARY``), built with g++ against the installed torch, for the tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

OP_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

// out = x * scale + OFFSET: arithmetic a test can check independently.
at::Tensor scale_plus(const at::Tensor& x, double scale) {
  return x.mul(scale).add(OFFSET);
}

// Shapes only: what torch.export traces with.
at::Tensor scale_plus_meta(const at::Tensor& x, double scale) {
  return at::empty_like(x);
}

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("scale_plus(Tensor x, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("scale_plus", scale_plus); }
TORCH_LIBRARY_IMPL(NAMESPACE, Meta, m) { m.impl("scale_plus", scale_plus_meta); }
"""

#: library name -> (namespace, OFFSET). The conformance suite gets a library of its own, so that
#: loading it there leaves this module's op unseen by the test process.
LIBRARIES = {"testops": ("neuropod_torch_test", 1), "conformanceops": ("neuropod_torch_conformance", 0)}

BUILD = r"""
import subprocess, sys, torch
from torch.utils import cpp_extension
src, out = sys.argv[1:3]
abi = int(torch.compiled_with_cxx11_abi())
procs = []
for arg in sys.argv[3:]:
    name, namespace, offset = arg.split(",")
    # -O0: it compiles twice as fast, and the op is a multiply-add.
    cmd = ["g++", "-shared", "-fPIC", "-O0", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-DNAMESPACE={namespace}", f"-DOFFSET={offset}", src, "-o", f"{out}/lib{name}.so"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-ltorch", "-ltorch_cpu", "-lc10"]
    cmd += [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    procs.append(subprocess.Popen(cmd))
assert all(p.wait(timeout=600) == 0 for p in procs), "g++ failed"
"""



class OpLibraries:
    """The built libraries: ``test_lib`` (``neuropod_torch_test::scale_plus``, x * scale + 1) and
    ``conformance_lib`` (``neuropod_torch_conformance::scale_plus``, x * scale)."""

    def __init__(self, work: Path):
        self.work = work
        self.test_lib = work / "libtestops.so"
        self.conformance_lib = work / "libconformanceops.so"


def build(work: Path) -> OpLibraries:
    """Build both libraries in ``work`` (a few seconds each, in parallel)."""
    (work / "op.cpp").write_text(OP_SOURCE)
    run_script(BUILD, work / "op.cpp", work, *[f"{name},{ns},{offset}" for name, (ns, offset) in LIBRARIES.items()])
    return OpLibraries(work)


def run_script(code: str, *args: object) -> None:
    """Run ``code`` in a new interpreter; fail with its output when it fails."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
