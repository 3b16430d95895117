"""Real custom ops, compiled here with g++ against the installed torch, loaded from packages.

The op libraries are built and the model that calls them is scripted in a
subprocess, so this test process has never seen the op when a package loads
it: only the backend's ``torch.ops.load_library`` can make it work.

torch aborts the whole interpreter (SIGABRT) when a library registers an op
or claims a namespace a second time, so every case where that could happen
(the caller loaded an op library before loading a package) runs in its own
subprocess and is judged by its exit code and output.
"""

from __future__ import annotations

import json
import os
import re
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

# One source, three builds: OFFSET tells which build ran an inference, OP
# which op name it defines in the namespace it claims with TORCH_LIBRARY.
OP_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>

// out = x * scale + OFFSET: arithmetic a test can check independently.
at::Tensor scale_plus(const at::Tensor& x, double scale) {
  return x.mul(scale).add(OFFSET);
}

TORCH_LIBRARY(neuropod_test_ops, m) {
  m.def(OP "(Tensor x, float scale) -> Tensor", scale_plus);
}
"""

#: build name -> (op name, OFFSET).
BUILDS = {
    "ours": ("scale_plus_one", 1),  # the package's library: x * 3 + 1
    "theirs": ("scale_plus_one", 2),  # another build of the same op (another file): x * 3 + 2
    "neighbour": ("scale_plus_five", 5),  # another op in the same TORCH_LIBRARY namespace
}

BUILD_AND_SCRIPT = r"""
import subprocess, sys, torch
from torch.utils import cpp_extension
src, out = sys.argv[1:3]
builds = dict(arg.split("=", 1) for arg in sys.argv[3:])
abi = int(torch.compiled_with_cxx11_abi())
procs = []
for name, define in builds.items():
    op, offset = define.split(",")
    # C++20: torch 2.14's headers need it (2.13's build with it too). -O0: it compiles twice as fast.
    cmd = ["g++", "-shared", "-fPIC", "-O0", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f'-DOP="{op}"', f"-DOFFSET={offset}", src, "-o", f"{out}/lib{name}.so"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-ltorch", "-ltorch_cpu", "-lc10"]
    cmd += [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    procs.append(subprocess.Popen(cmd))
assert all(p.wait(timeout=600) == 0 for p in procs), "g++ failed"
torch.ops.load_library(f"{out}/libours.so")

class UsesOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": torch.ops.neuropod_test_ops.scale_plus_one(x, 3.0)}

torch.jit.save(torch.jit.script(UsesOp()), f"{out}/uses_op.pt")
"""

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the custom ops")

IN_SPEC, OUT_SPEC = spec(("x", "float32", [None])), spec(("y", "float32", [None]))
X = np.array([0, 1, 2.5], np.float32)


class Ops:
    """The compiled libraries and the scripted model that calls ``scale_plus_one``."""

    def __init__(self, work: Path):
        self.work = work
        self.ours, self.theirs, self.neighbour = (work / f"lib{name}.so" for name in BUILDS)
        self.model = work / "uses_op.pt"


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Ops:
    work = tmp_path_factory.mktemp("op")
    (work / "op.cpp").write_text(OP_SOURCE)
    (work / "build.py").write_text(BUILD_AND_SCRIPT)
    builds = [f"{name}={op},{offset}" for name, (op, offset) in BUILDS.items()]
    subprocess.run([sys.executable, str(work / "build.py"), str(work / "op.cpp"), str(work), *builds],
                   check=True, timeout=900)  # fmt: skip
    return Ops(work)


def run_script(tmp_path: Path, code: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script file (torch.jit.script reads classes' source) in a new interpreter."""
    script = tmp_path / f"script_{len(list(tmp_path.glob('script_*.py')))}.py"
    preamble = "import json, sys, warnings\nimport numpy as np\nimport torch\nimport neuropod\n"
    script.write_text(preamble + textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=timeout,
        env=os.environ.copy(),
    )  # fmt: skip


def last_json(done: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    """The JSON a script printed last; fails with its output when it did not finish."""
    assert done.returncode == 0, f"exit code {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_custom_op_loaded_from_the_package(ops: Ops, tmp_path: Path) -> None:
    assert not hasattr(torch.ops.neuropod_test_ops, "scale_plus_one"), "this process has not loaded the op"

    # Without the library the module cannot even be loaded: the op is unknown.
    with pytest.raises(BackendError, match="neuropod_test_ops"):
        create_torchscript_neuropod(tmp_path / "no_ops", "uses_op", IN_SPEC, OUT_SPEC, module_path=ops.model)
    assert not (tmp_path / "no_ops").exists()

    path = create_torchscript_neuropod(
        tmp_path / "ops", "uses_op", IN_SPEC, OUT_SPEC, module_path=ops.model, custom_ops=[ops.ours],
        test_input_data={"x": X}, test_expected_out={"y": X * 3 + 1},
    )  # fmt: skip
    assert (path / "0" / "ops" / ops.ours.name).read_bytes() == ops.ours.read_bytes()
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_allclose(m.infer({"x": X})["y"], X * 3 + 1)


def test_caller_loaded_the_library_then_packaged_it(ops: Ops, tmp_path: Path) -> None:
    """The original Neuropod's workflow: load the op library, script a model that uses it,
    package it with custom_ops=[that library] and test data; then load it in the same process."""
    done = run_script(
        tmp_path,
        """
        from neuropod.packagers import create_torchscript_neuropod

        lib, out = sys.argv[1:3]
        torch.ops.load_library(lib)

        class UsesOp(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.ops.neuropod_test_ops.scale_plus_one(x, 3.0)

        x = np.array([0, 1, 2.5], np.float32)
        spec_in = [{"name": "x", "dtype": "float32", "shape": [None]}]
        spec_out = [{"name": "y", "dtype": "float32", "shape": [None]}]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = create_torchscript_neuropod(
                out, "uses_op", spec_in, spec_out, module=torch.jit.script(UsesOp()), custom_ops=[lib],
                test_input_data={"x": x}, test_expected_out={"y": x * 3 + 1},
            )
            with neuropod.load_neuropod(path) as model:
                y = model.infer({"x": x})["y"]
                kind = type(model).__name__
        print(json.dumps({"y": y.tolist(), "kind": kind, "warnings": [str(w.message) for w in caught]}))
        """,
        ops.ours, tmp_path / "pkg",
    )  # fmt: skip
    result = last_json(done)
    assert result["y"] == (X * 3 + 1).tolist()
    assert result["kind"] == "NeuropodModel", "the library already in the process is reused: the model runs in-process"
    assert not [w for w in result["warnings"] if "worker process" in w]


def test_two_packages_with_the_same_library_in_one_process(ops: Ops, tmp_path: Path) -> None:
    """The same library in two packages (a directory and a zip, under two file names) is loaded once."""
    first = create_torchscript_neuropod(
        tmp_path / "first", "first", IN_SPEC, OUT_SPEC, module_path=ops.model, custom_ops=[ops.ours]
    )
    renamed = tmp_path / "renamed" / "libsame_content.so"
    renamed.parent.mkdir()
    shutil.copyfile(ops.ours, renamed)
    second = create_torchscript_neuropod(
        tmp_path / "second.zip", "second", IN_SPEC, OUT_SPEC, module_path=ops.model, custom_ops=[renamed],
        package_as_zip=True,
    )  # fmt: skip
    done = run_script(
        tmp_path,
        """
        results = {}
        for path in sys.argv[1:3]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = neuropod.load_neuropod(path)
            results[model.name] = {
                "y": model.infer({"x": np.array([0, 1, 2.5], np.float32)})["y"].tolist(),
                "kind": type(model).__name__,
                "warnings": [str(w.message) for w in caught],
            }
        print(json.dumps(results))
        """,
        first, second,
    )  # fmt: skip
    results = last_json(done)
    for name in ("first", "second"):
        assert results[name]["y"] == (X * 3 + 1).tolist()
        assert results[name]["kind"] == "NeuropodModel" and not results[name]["warnings"]
    # What the probe learnt about the library is kept in the cache, per content and torch version.
    (probe,) = (Path(os.environ["NEUROPOD_CACHE_DIR"]) / "probes").glob("torch-ops-*.json")
    assert torch.__version__ in probe.name
    learnt = {"ops": ["neuropod_test_ops::scale_plus_one"], "namespaces": ["neuropod_test_ops"]}
    assert json.loads(probe.read_text()) == learnt
    # A damaged entry is probed again (in a subprocess: this process does not load the library).
    from neuropod.probe import torch_library_registrations as library_registrations

    probe.write_text('["not", "an", "answer"]')
    assert library_registrations(ops.ours, torch.__version__, "test") == learnt


@pytest.mark.parametrize(
    ("caller_loads", "why"),
    [
        ("theirs", "defines op(s) 'neuropod_test_ops::scale_plus_one', which this process already has"),
        ("neighbour", "claims the op namespace(s) 'neuropod_test_ops' (TORCH_LIBRARY)"),
    ],
)
def test_same_ops_from_another_file_run_in_a_worker(ops: Ops, tmp_path: Path, caller_loads: str, why: str) -> None:
    """The caller has loaded another build of the package's ops (or another library claiming
    their namespace): loading the package's library would abort the process, so packaging's
    check and load_neuropod run the model in a worker process, with a warning."""
    done = run_script(
        tmp_path,
        """
        from neuropod.packagers import create_torchscript_neuropod

        own_lib, package_lib, model_file, out = sys.argv[1:5]
        torch.ops.load_library(own_lib)
        x = np.array([0, 1, 2.5], np.float32)
        spec_in = [{"name": "x", "dtype": "float32", "shape": [None]}]
        spec_out = [{"name": "y", "dtype": "float32", "shape": [None]}]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # The package's build computes x * 3 + 1: the check passes only where that build ran.
            path = create_torchscript_neuropod(
                out, "uses_op", spec_in, spec_out, module_path=model_file, custom_ops=[package_lib],
                test_input_data={"x": x}, test_expected_out={"y": x * 3 + 1},
            )
            with neuropod.load_neuropod(path) as model:
                y = model.infer({"x": x})["y"]
                kind = type(model).__name__
        ops = torch.ops.neuropod_test_ops
        mine = ops.scale_plus_one(torch.from_numpy(x), 3.0) if hasattr(ops, "scale_plus_one") else None
        print(json.dumps({
            "y": y.tolist(), "kind": kind, "warnings": [str(w.message) for w in caught],
            "mine": None if mine is None else mine.tolist(),
        }))
        """,
        getattr(ops, caller_loads), ops.ours, ops.model, tmp_path / "pkg",
    )  # fmt: skip
    result = last_json(done)
    assert result["y"] == (X * 3 + 1).tolist(), "the package's own build ran the model"
    assert result["kind"] == "WorkerModel"
    moved = [w for w in result["warnings"] if "runs in a worker process instead" in w]
    assert moved, result["warnings"]  # from packaging's check and from load_neuropod
    assert all(f"custom op library {ops.ours.name} cannot be loaded into this process: it {why}" in w for w in moved)
    if caller_loads == "theirs":
        assert result["mine"] == (X * 3 + 2).tolist(), "the caller's own op is untouched"


BAD_LIBRARIES = {
    # dlopen fails: the library needs a symbol nobody provides.
    "missing_symbol": "extern void neuropod_test_missing(void);\n"
    "__attribute__((constructor)) static void init(void) { neuropod_test_missing(); }\n",
    # dlopen runs its initializer, which aborts: as torch does on a double registration.
    "aborts": "#include <stdlib.h>\n__attribute__((constructor)) static void init(void) { abort(); }\n",
}


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing_symbol", "the probe exited with code 1:\nOSError: .*undefined symbol: neuropod_test_missing"),
        ("aborts", "the probe was killed by SIGABRT; loading it into this process would have ended it the same way"),
    ],
)
def test_library_that_fails_its_probe(tmp_path: Path, kind: str, message: str) -> None:
    """A library that cannot be loaded, or that kills the process loading it, is a clear
    PackageError from the probe: this process never loads it."""
    source = tmp_path / f"{kind}.c"
    source.write_text(BAD_LIBRARIES[kind])
    lib = tmp_path / f"lib{kind}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(source), "-o", str(lib)], check=True, timeout=120)
    done = run_script(
        tmp_path,
        """
        import os

        from neuropod.errors import PackageError
        from neuropod.packagers import create_torchscript_neuropod

        class Plain(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + 1

        lib, out = sys.argv[1:3]
        spec_in = [{"name": "x", "dtype": "float32", "shape": [None]}]
        spec_out = [{"name": "y", "dtype": "float32", "shape": [None]}]
        try:
            create_torchscript_neuropod(out, "plain", spec_in, spec_out, module=torch.jit.script(Plain()), custom_ops=[lib])
        except PackageError as e:
            print(json.dumps({"error": str(e), "kept": os.path.exists(out)}))
        """,
        lib, tmp_path / "pkg",
    )  # fmt: skip
    result = last_json(done)
    assert f"custom op library lib{kind}.so failed to load in torch {torch.__version__}" in result["error"]
    assert re.search(message, result["error"]), result["error"]
    assert not result["kept"], "a package that cannot load is not kept"


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
