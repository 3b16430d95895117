"""A real TensorFlow op, compiled with g++ against the installed TensorFlow's headers.

The library is built, and the frozen graph that uses it written, in a
subprocess: this test process has never loaded the op when the package is
loaded, so only the backend's ``tf.load_op_library`` can make it work.
"""

from __future__ import annotations

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
"""

BUILD_AND_FREEZE = r"""
import os, subprocess, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
src, lib, graph_path = sys.argv[1:4]
cmd = ["g++", "-shared", "-fPIC", "-O1", "-w", "-std=c++17", src, "-o", lib]
cmd += tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
subprocess.run(cmd, check=True)
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
    work = tmp_path_factory.mktemp("op")
    (work / "op.cc").write_text(OP_SOURCE)
    (work / "build.py").write_text(textwrap.dedent(BUILD_AND_FREEZE))
    lib, graph = work / "libneuropod_tf_test_ops.so", work / "graph.pb"
    subprocess.run([sys.executable, str(work / "build.py"), str(work / "op.cc"), str(lib), str(graph)], check=True)
    return lib, graph


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
