"""The model behind ``neuropod demo tensorflow``: ``out = (x + y) * 2`` as a frozen graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuropod.plugins import import_framework
from neuropod_tensorflow._quiet import import_tensorflow

INPUT_SPEC = [
    {"name": "x", "dtype": "float32", "shape": ["batch_size", 2]},
    {"name": "y", "dtype": "float32", "shape": ["batch_size", 2]},
]
OUTPUT_SPEC = [{"name": "out", "dtype": "float32", "shape": ["batch_size", 2]}]


def build_demo(directory: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Package the demo model in ``directory``.

    :returns: the package path, inputs that fit, and inputs whose
        ``batch_size`` disagree (for showing a spec error).
    """
    import numpy as np

    # lazy: numpy (the packager imports it), kept out of importing this module (as numpy above)
    from neuropod_tensorflow.packager import create_tensorflow_neuropod

    tf = import_framework("tensorflow", "tensorflow", "neuropod demo tensorflow", import_tensorflow)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 2], name="y")
        tf.multiply(tf.add(x, y), 2.0, name="out")
    xs = np.array([[1, 2], [3, 4]], dtype=np.float32)
    ys = np.array([[7, 8], [9, 10]], dtype=np.float32)
    path = create_tensorflow_neuropod(
        Path(directory) / "demo_adder.neuropod",
        "demo_adder",
        INPUT_SPEC,
        OUTPUT_SPEC,
        node_name_mapping={"x": "x", "y": "y", "out": "out"},
        graph_def=graph.as_graph_def(),
        platform_version_semver=">=2.12",
        test_input_data={"x": xs, "y": ys},
        test_expected_out={"out": (xs + ys) * 2},
    )
    return path, {"x": xs, "y": ys}, {"x": xs, "y": np.ones((3, 2), dtype=np.float32)}
