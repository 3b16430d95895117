"""The TensorFlow backend against the core's conformance suite (``neuropod.testing``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

from neuropod.packagers import create_tensorflow_neuropod
from neuropod.testing import ALL_DTYPES, BackendConformance, accumulator_spec


def _identity_graph(input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]]) -> tf.compat.v1.GraphDef:
    """A frozen graph with one placeholder and one ``tf.identity`` per input/output pair."""
    graph = tf.Graph()
    with graph.as_default():
        for i, o in zip(input_spec, output_spec):
            dtype = tf.string if i["dtype"] == "string" else tf.as_dtype(i["dtype"])
            shape = [d if isinstance(d, int) else None for d in i["shape"]]
            x = tf.compat.v1.placeholder(dtype, shape, name=i["name"])
            tf.identity(x, name=o["name"])
    return graph.as_graph_def()


def _accumulator_graph() -> tf.compat.v1.GraphDef:
    """``y = acc_in + x`` and ``acc_out``, an identity of ``y``: float32 ``[None, 4]`` each."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        acc_in = tf.compat.v1.placeholder(tf.float32, [None, 4], name="acc_in")
        y = tf.add(acc_in, x, name="y")
        tf.identity(y, name="acc_out")
    return graph.as_graph_def()


class TestTensorFlowConformance(BackendConformance):
    platform = "tensorflow"
    distribution = "neuropod-tensorflow"
    framework_modules = ("tensorflow", "keras")
    dtypes = ALL_DTYPES
    custom_ops = True

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        mapping = {s["name"]: s["name"] for s in [*input_spec, *output_spec]}
        path: Path = create_tensorflow_neuropod(
            tmp_path / name, name, input_spec, output_spec, node_name_mapping=mapping,
            graph_def=_identity_graph(input_spec, output_spec), **packager_kwargs,
        )
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        input_spec, output_spec = accumulator_spec()
        mapping = {s["name"]: s["name"] for s in [*input_spec, *output_spec]}
        path: Path = create_tensorflow_neuropod(
            tmp_path / name, name, input_spec, output_spec, node_name_mapping=mapping,
            graph_def=_accumulator_graph(), **packager_kwargs,
        )  # fmt: skip
        return path

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        pytest.skip("compiling a TensorFlow op library takes about a minute; tests/test_custom_op.py builds and loads one")
