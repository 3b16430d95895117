"""Tensor names with '/', ':' and '.' on TensorFlow packages: a frozen graph maps spec names to its
tensors (whose names are like that already), and a SavedModel's signature keys are the spec's names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

import neuropod
from neuropod.packagers import create_tensorflow_neuropod

from conftest import spec

IN = "input/x:0"
OUT = "InceptionV3/Predictions/Softmax:0"


def test_frozen_graph_with_its_own_tensor_names_as_spec_names(tmp_path: Path) -> None:
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="input/x")
        tf.nn.softmax(x, name="InceptionV3/Predictions/Softmax")
    x = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], np.float32)
    path = create_tensorflow_neuropod(
        tmp_path / "frozen", "frozen", spec((IN, "float32", ["batch", 3])), spec((OUT, "float32", ["batch", 3])),
        node_name_mapping={IN: IN, OUT: OUT}, graph_def=graph.as_graph_def(), test_input_data={IN: x},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        out = model.infer({IN: x})
    np.testing.assert_allclose(out[OUT], tf.nn.softmax(x).numpy(), rtol=1e-6)


class Named(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serving_default(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"scores/out:0": x * 2.0, "out.1": x + 1.0}


def test_saved_model_signature_output_keys_with_slashes_colons_and_dots(tmp_path: Path) -> None:
    x = np.array([1.0, -2.0], np.float32)
    path = create_tensorflow_neuropod(
        tmp_path / "saved", "saved", spec(("x", "float32", ["n"])),
        spec(("scores/out:0", "float32", ["n"]), ("out.1", "float32", ["n"])), trackable_obj=Named(),
        test_input_data={"x": x},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": x})
    np.testing.assert_array_equal(out["scores/out:0"], x * 2)
    np.testing.assert_array_equal(out["out.1"], x + 1)
