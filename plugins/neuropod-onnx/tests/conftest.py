"""Real ONNX models built with onnx.helper, and a private package cache per test."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from neuropod import envs
from neuropod_onnx import _installed

# onnxruntime writes a device id and a telemetry database under
# $XDG_CACHE_HOME/Microsoft (~/.cache/Microsoft by default) when it is imported.
# Tests must not write to the user's home: point it (for this process and the
# workers it starts) at a directory removed when the run ends.
_XDG_CACHE = tempfile.mkdtemp(prefix="neuropod-tests-xdg-cache-")
os.environ["XDG_CACHE_HOME"] = _XDG_CACHE
atexit.register(shutil.rmtree, _XDG_CACHE, True)

FIXTURES = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "uber-neuropod-0.3"

ONNX_TYPES = {
    "float16": TensorProto.FLOAT16,
    "float32": TensorProto.FLOAT,
    "float64": TensorProto.DOUBLE,
    "int8": TensorProto.INT8,
    "int16": TensorProto.INT16,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
    "uint8": TensorProto.UINT8,
    "uint16": TensorProto.UINT16,
    "uint32": TensorProto.UINT32,
    "uint64": TensorProto.UINT64,
    "bool": TensorProto.BOOL,
    "string": TensorProto.STRING,
}


@pytest.fixture(autouse=True)
def _private_cache(neuropod_cache: Path) -> Path:
    # neuropod.testing's fixture (a pytest plugin wherever neuropod is installed), for every test here.
    return neuropod_cache


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[tuple[str, str, Sequence[Any]]],
    outputs: Sequence[tuple[str, str, Sequence[Any]]],
    initializers: Sequence[onnx.TensorProto] = (),
    extra_opsets: Sequence[tuple[str, int]] = (),
) -> onnx.ModelProto:
    """An ONNX model (IR 8, opset 17) from nodes and (name, dtype, shape) triples."""
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(n, ONNX_TYPES[t], list(s)) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, ONNX_TYPES[t], list(s)) for n, t, s in outputs],
        initializer=list(initializers),
    )
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8  # readable by every onnxruntime in the test matrix
    onnx.checker.check_model(model)
    return model


def spec(*entries: tuple[str, str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in entries]


@pytest.fixture
def adder_model() -> onnx.ModelProto:
    """out = x + y over float32 [batch_size, 2]; also doubled = out * 2."""
    return make_model(
        [
            helper.make_node("Add", ["x", "y"], ["out"]),
            helper.make_node("Mul", ["out", "two"], ["doubled"]),
        ],
        [("x", "float32", ["batch_size", 2]), ("y", "float32", ["batch_size", 2])],
        [("out", "float32", ["batch_size", 2]), ("doubled", "float32", ["batch_size", 2])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )


ADDER_INPUT_SPEC = spec(("x", "float32", ["batch_size", 2]), ("y", "float32", ["batch_size", 2]))
ADDER_OUTPUT_SPEC = spec(("out", "float32", ["batch_size", 2]), ("doubled", "float32", ["batch_size", 2]))


@pytest.fixture
def make_adder(tmp_path: Path, adder_model: onnx.ModelProto) -> Callable[..., Path]:
    """Package the adder; keyword arguments go to create_onnx_neuropod."""
    from neuropod.packagers import create_onnx_neuropod

    counter = iter(range(1000))

    def make(**kwargs: Any) -> Path:
        kwargs.setdefault("input_spec", ADDER_INPUT_SPEC)
        kwargs.setdefault("output_spec", ADDER_OUTPUT_SPEC)
        path: Path = create_onnx_neuropod(
            tmp_path / f"adder{next(counter)}.neuropod", "adder", onnx_model=adder_model, **kwargs
        )
        return path

    return make


def xy(batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {
        "x": rng.standard_normal((batch, 2)).astype(np.float32),
        "y": rng.standard_normal((batch, 2)).astype(np.float32),
    }


# The onnxruntime releases of the backend environments (tests that set NEUROPOD_TEST_ENVS=1; nox -s tests_envs).
OLD, NEWER = "1.20.1", "1.24.4"


@pytest.fixture(scope="session")
def two_envs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, envs.Environment]]:
    """Backend environments of onnxruntime OLD and NEWER in the session's own NEUROPOD_HOME, made once
    for every test file of the session that uses them (they download onnxruntime)."""
    here = _installed()[0][1]
    if here in (OLD, NEWER):
        pytest.skip(f"this process runs onnxruntime {here}; the environments need a version it does not have")
    home = tmp_path_factory.mktemp("neuropod-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEUROPOD_HOME", str(home))
        made = {}
        for version in (OLD, NEWER):
            t0 = time.perf_counter()
            made[version] = envs.create_environment(f"onnx=={version}", out=sys.stderr)
            print(f"created onnx=={version} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        yield made
