"""A real TensorFlow op, compiled with g++ against the installed TensorFlow's headers.

The library is built, and the frozen graph that uses it written, in a
subprocess: this test process has never loaded the op when the package is
loaded, so only the backend's ``tf.load_op_library`` can make it work.

The original Neuropod's workflow (load the op library, build the model with
it, package it with ``custom_ops=[that library]``) and the other ways one op
can reach a process twice run in subprocesses of their own: a second
registration of an op could take the whole interpreter down.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.errors import BackendError, PackageError
from neuropod.packagers import create_tensorflow_neuropod

from conftest import spec

OP_SOURCE = r"""
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"

using namespace tensorflow;

// y = x * 3 + 1: arithmetic a test can check independently.
REGISTER_OP("NeuropodScalePlusOne")
    .Input("x: float")
    .Output("y: float")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);

class ScalePlusOneOp : public OpKernel {
 public:
  explicit ScalePlusOneOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    auto in = x.flat<float>();
    auto out = y->flat<float>();
    for (int64_t i = 0; i < in.size(); ++i) out(i) = in(i) * 3.0f + 1.0f;
  }
};

REGISTER_KERNEL_BUILDER(Name("NeuropodScalePlusOne").Device(DEVICE_CPU), ScalePlusOneOp);

#ifdef NEUROPOD_VARIANT
// Another build of the same ops: other bytes, the same op names.
extern "C" int neuropod_variant() { return NEUROPOD_VARIANT; }
#endif
"""

# A library that takes down whoever loads it.
ABORTS_ON_LOAD = r"""
#include <stdlib.h>
__attribute__((constructor)) static void take_the_process_down(void) { abort(); }
"""

BUILD_AND_FREEZE = r"""
import os, subprocess, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
src, lib, graph_path, variant = sys.argv[1:5]
flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
for out, extra in ((lib, []), (variant, ["-DNEUROPOD_VARIANT=2"])):
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-w", "-std=c++17", *extra, src, "-o", out, *flags], check=True)
ops = tf.load_op_library(lib)
graph = tf.Graph()
with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    ops.neuropod_scale_plus_one(x, name="y")
with open(graph_path, "wb") as f:
    f.write(graph.as_graph_def().SerializeToString())
"""

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the custom op")
MAPPING = {"x": "x", "y": "y"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The op library and a frozen graph that uses it."""
    work = tmp_path_factory.mktemp("op")
    (work / "op.cc").write_text(OP_SOURCE)
    (work / "build.py").write_text(textwrap.dedent(BUILD_AND_FREEZE))
    (work / "variant").mkdir()
    lib, graph = work / "libneuropod_tf_test_ops.so", work / "graph.pb"
    variant = work / "variant" / lib.name
    subprocess.run(
        [sys.executable, str(work / "build.py"), str(work / "op.cc"), str(lib), str(graph), str(variant)],
        check=True, timeout=600,
    )  # fmt: skip
    assert variant.read_bytes() != lib.read_bytes()
    return lib, graph


@pytest.fixture(scope="module")
def variant(compiled: tuple[Path, Path]) -> Path:
    """Another build of the same op library (other bytes, same op names), in another folder."""
    return compiled[0].parent / "variant" / compiled[0].name


def test_custom_op_loaded_from_the_package(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    lib, graph = compiled
    in_spec, out_spec = spec(("x", "float32", [None])), spec(("y", "float32", [None]))
    x = np.array([0, 1, 2.5], np.float32)
    with pytest.raises(BackendError, match="NeuropodScalePlusOne"):
        create_tensorflow_neuropod(tmp_path / "no_ops", "op", in_spec, out_spec, node_name_mapping=MAPPING,
                                   frozen_graph_path=graph)  # fmt: skip
    assert not (tmp_path / "no_ops").exists()
    path = create_tensorflow_neuropod(
        tmp_path / "ops", "op", in_spec, out_spec, node_name_mapping=MAPPING, frozen_graph_path=graph,
        custom_ops=[lib], test_input_data={"x": x}, test_expected_out={"y": x * 3 + 1},
    )
    assert (path / "0" / "ops" / lib.name).read_bytes() == lib.read_bytes()
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_allclose(m.infer({"x": x})["y"], x * 3 + 1)
    again = create_tensorflow_neuropod(tmp_path / "ops2", "op", in_spec, out_spec, node_name_mapping=MAPPING,
                                       frozen_graph_path=graph, custom_ops=[lib])  # fmt: skip
    with neuropod.load_neuropod(again) as m:  # the same library again: loaded once per process
        np.testing.assert_allclose(m.infer({"x": x})["y"], x * 3 + 1)


def test_custom_op_file_that_fails_to_load(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    _, graph = compiled
    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not a shared library")
    with pytest.raises(PackageError, match="custom op library libbogus.so failed to load in tensorflow"):
        create_tensorflow_neuropod(
            tmp_path / "p", "op", spec(("x", "float32", [None])), spec(("y", "float32", [None])),
            node_name_mapping=MAPPING, frozen_graph_path=graph, custom_ops=[bogus],
        )
    assert not (tmp_path / "p").exists()


# --- the same ops twice in one process (each in a subprocess of its own) ----------

# Prelude of the scripts below: builds the graph with the op library the
# script loaded itself, as a user does before packaging, and reports as JSON.
PRELUDE = r"""
import json, os, sys, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
import neuropod
from neuropod.packagers import create_tensorflow_neuropod

SPECS = dict(input_spec=[{"name": "x", "dtype": "float32", "shape": [None]}],
             output_spec=[{"name": "y", "dtype": "float32", "shape": [None]}],
             node_name_mapping={"x": "x", "y": "y"})
X = np.array([0, 1, 2.5], np.float32)


def user_graph(lib):
    ops = tf.load_op_library(lib)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        ops.neuropod_scale_plus_one(x, name="y")
    return graph.as_graph_def()


def mapped(path):
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


def report(**facts):
    print("RESULT " + json.dumps(facts))
"""


def _run(script: str, *args: object, timeout: float = 400) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result: dict[str, object] = json.loads(line[len("RESULT ") :])
    return result


def test_op_library_loaded_by_the_user_then_packaged(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    """The original's workflow: the package's copy is the library already loaded, so it is not loaded again."""
    lib, _ = compiled
    result = _run(
        """
        lib, out = sys.argv[1:3]
        graph_def = user_graph(lib)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = create_tensorflow_neuropod(out, "op", graph_def=graph_def, custom_ops=[lib],
                                              test_input_data={"x": X}, test_expected_out={"y": X * 3 + 1}, **SPECS)
            with neuropod.load_neuropod(path) as model:
                y = model.infer({"x": X})["y"]
                kind = type(model).__name__
        report(y=y.tolist(), kind=kind, warnings=[str(w.message) for w in caught],
               package_copy_mapped=mapped(path / "0" / "ops" / os.path.basename(lib)))
        """,
        lib, tmp_path / "pkg",
    )  # fmt: skip
    assert result["y"] == [1.0, 4.0, 8.5]
    assert result["kind"] == "NeuropodModel", "ran in this process"
    assert not [w for w in result["warnings"] if "worker process" in w]  # type: ignore[union-attr]
    assert result["package_copy_mapped"] is False, "the user's library was reused, not the package's copy loaded"


def test_two_packages_holding_the_same_library(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    lib, graph = compiled
    result = _run(
        """
        lib, graph, a, b = sys.argv[1:5]
        paths = [create_tensorflow_neuropod(p, "op", frozen_graph_path=graph, custom_ops=[lib], **SPECS) for p in (a, b)]
        with neuropod.load_neuropod(paths[0]) as first, neuropod.load_neuropod(paths[1], use_ope=False) as second:
            ys = [m.infer({"x": X})["y"].tolist() for m in (first, second)]
            kinds = [type(m).__name__ for m in (first, second)]
        probes = os.listdir(os.path.join(os.environ["NEUROPOD_CACHE_DIR"], "probes"))
        report(ys=ys, kinds=kinds, probes=probes, mapped=[mapped(p / "0" / "ops" / os.path.basename(lib)) for p in paths])
        """,
        lib, graph, tmp_path / "a", tmp_path / "b",
    )  # fmt: skip
    assert result["ys"] == [[1.0, 4.0, 8.5]] * 2
    assert result["kinds"] == ["NeuropodModel"] * 2
    assert result["mapped"].count(True) == 1, "one copy loaded, for both"  # type: ignore[union-attr]
    assert len(result["probes"]) == 1, "the library's ops were learnt once"  # type: ignore[arg-type]


def test_same_ops_from_another_file_run_in_a_worker(
    compiled: tuple[Path, Path], variant: Path, tmp_path: Path
) -> None:
    """The user loaded their build of the ops; the package holds another build: OPE, with a warning."""
    lib, _ = compiled
    result = _run(
        """
        lib, variant, out = sys.argv[1:4]
        graph_def = user_graph(lib)
        with warnings.catch_warnings(record=True) as packaging:
            warnings.simplefilter("always")
            path = create_tensorflow_neuropod(out, "op", graph_def=graph_def, custom_ops=[variant],
                                              test_input_data={"x": X}, test_expected_out={"y": X * 3 + 1}, **SPECS)
        with warnings.catch_warnings(record=True) as loading:
            warnings.simplefilter("always")
            with neuropod.load_neuropod(path) as model:
                y = model.infer({"x": X})["y"]
                kind = type(model).__name__
        report(y=y.tolist(), kind=kind, packaging=[str(w.message) for w in packaging],
               loading=[str(w.message) for w in loading], variant_mapped=mapped(path / "0" / "ops" / os.path.basename(variant)))
        """,
        lib, variant, tmp_path / "pkg",
    )  # fmt: skip
    assert result["y"] == [1.0, 4.0, 8.5]
    assert result["kind"] == "WorkerModel"
    assert result["variant_mapped"] is False, "the other build never entered the caller's process"
    for when in ("packaging", "loading"):
        (warning,) = [w for w in result[when] if "worker process" in w]  # type: ignore[union-attr]
        assert "libneuropod_tf_test_ops.so cannot be loaded into this process" in warning
        assert "'NeuropodScalePlusOne', which this process already has" in warning
        assert "runs in a worker process instead (OPE)" in warning


def test_library_that_crashes_the_probe(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    """A library that aborts whoever loads it: a clear error here, and this process lives on."""
    _, graph = compiled
    (tmp_path / "boom.c").write_text(ABORTS_ON_LOAD)
    boom = tmp_path / "libboom.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(tmp_path / "boom.c"), "-o", str(boom)], check=True, timeout=120)
    result = _run(
        """
        graph, boom, out = sys.argv[1:4]
        try:
            create_tensorflow_neuropod(out, "op", frozen_graph_path=graph, custom_ops=[boom], **SPECS)
        except neuropod.NeuropodError as e:
            report(error=[c.__name__ for c in type(e).__mro__], message=str(e), kept=os.path.exists(out))
        """,
        graph, boom, tmp_path / "pkg",
    )  # fmt: skip
    assert "PackageError" in result["error"] and "ValueError" in result["error"]  # type: ignore[operator]
    message = str(result["message"])
    assert "custom op library libboom.so failed to load in tensorflow" in message
    assert "loaded alone in a fresh process" in message and "killed by SIGABRT" in message
    assert result["kept"] is False


def test_package_without_custom_ops_never_probes(tmp_path: Path) -> None:
    result = _run(
        """
        graph = tf.Graph()
        with graph.as_default():
            tf.identity(tf.compat.v1.placeholder(tf.float32, [None], name="x"), name="y")
        path = create_tensorflow_neuropod(sys.argv[1], "plain", graph_def=graph.as_graph_def(), **SPECS)
        with neuropod.load_neuropod(path) as model:
            y = model.infer({"x": X})["y"]
        report(y=y.tolist(), probes=os.path.exists(os.path.join(os.environ["NEUROPOD_CACHE_DIR"], "probes")))
        """,
        tmp_path / "plain",
    )  # fmt: skip
    assert result == {"y": [0.0, 1.0, 2.5], "probes": False}
