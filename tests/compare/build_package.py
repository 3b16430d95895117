"""Package the comparison tests' model for one framework: ``python build_package.py FRAMEWORK DIR [--perturb]``.

The model: ``scores = tanh(x @ W1 + b1) @ W2 + b2`` and ``label = argmax(scores, -1)`` (int32),
``x`` float32 ``[batch_size, 4]``, the weights from ``numpy.random.default_rng(0)``
(:func:`weights`). FRAMEWORK is onnx, torch_export, torchscript, jax or tensorflow; the
package is written to ``DIR/<FRAMEWORK>.neuropod`` (``DIR/<FRAMEWORK>_perturbed.neuropod``
with ``--perturb``: one weight of W2 changed, :data:`PERTURBED`) and its path printed.
The ONNX package alone carries test data (:func:`sample_inputs`).

Each framework is built in a process of its own (the tests run this script with
``sys.executable``): torch and TensorFlow must never be imported in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

FRAMEWORKS = ("onnx", "torch_export", "torchscript", "jax", "tensorflow")

INPUT_SPEC: list[dict[str, Any]] = [{"name": "x", "dtype": "float32", "shape": ["batch_size", 4]}]
OUTPUT_SPEC: list[dict[str, Any]] = [
    {"name": "scores", "dtype": "float32", "shape": ["batch_size", 3]},
    {"name": "label", "dtype": "int32", "shape": ["batch_size"]},
]

#: The weight ``--perturb`` changes (row, column of W2) and by how much: it moves column 1 of ``scores`` only.
PERTURBED = (2, 1, 0.25)


def weights(perturb: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = {
        "w1": rng.standard_normal((4, 8)).astype(np.float32),
        "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 3)).astype(np.float32),
        "b2": rng.standard_normal(3).astype(np.float32),
    }
    if perturb:
        row, column, delta = PERTURBED
        w["w2"][row, column] += np.float32(delta)
    return w


def sample_inputs() -> dict[str, np.ndarray]:
    """The ONNX package's test data: 6 rows."""
    return {"x": np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)}


def reference(x: np.ndarray, perturb: bool = False) -> dict[str, np.ndarray]:
    """The model in numpy (float64, then float32)."""
    w = {k: v.astype(np.float64) for k, v in weights(perturb).items()}
    hidden = np.tanh(x.astype(np.float64) @ w["w1"] + w["b1"])
    scores = hidden @ w["w2"] + w["b2"]
    return {"scores": scores.astype(np.float32), "label": scores.argmax(-1).astype(np.int32)}


def hidden(x: np.ndarray) -> np.ndarray:
    """The hidden layer's activations, tanh(x @ W1 + b1), in float64."""
    w = weights()
    return np.tanh(x.astype(np.float64) @ w["w1"].astype(np.float64) + w["b1"].astype(np.float64))


def build_onnx(path: Path, w: dict[str, np.ndarray], test_data: bool) -> Path:
    import onnx  # lazy: a framework, imported only by the build that needs it
    from onnx import TensorProto, helper, numpy_helper

    from neuropod_onnx.packager import create_onnx_neuropod  # lazy: pulls in the framework's plugin

    inits = [numpy_helper.from_array(v, name=k) for k, v in w.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["xw1"]),
        helper.make_node("Add", ["xw1", "b1"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["hw2"]),
        helper.make_node("Add", ["hw2", "b2"], ["scores"]),
        helper.make_node("ArgMax", ["scores"], ["label64"], axis=-1, keepdims=0),
        helper.make_node("Cast", ["label64"], ["label"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 4])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch_size", 3]),
            helper.make_tensor_value_info("label", TensorProto.INT32, ["batch_size"]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    options: dict[str, Any] = {}
    if test_data:
        x = sample_inputs()["x"]
        options.update(test_input_data={"x": x}, test_expected_out=reference(x))
    return create_onnx_neuropod(path, "mlp", INPUT_SPEC, OUTPUT_SPEC, onnx_model=model, **options)


def _torch_module(w: dict[str, np.ndarray]) -> Any:
    import torch  # lazy: a framework, imported only by the build that needs it

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, value in w.items():
                self.register_buffer(name, torch.from_numpy(value.copy()))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            scores = torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2
            return {"scores": scores, "label": scores.argmax(dim=-1).to(torch.int32)}

    return Mlp().eval()


def build_torch_export(path: Path, w: dict[str, np.ndarray]) -> Path:
    from neuropod_torch.packager import create_torch_export_neuropod  # lazy: pulls in torch

    example = {"x": np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)}
    return create_torch_export_neuropod(
        path, "mlp", INPUT_SPEC, OUTPUT_SPEC, module=_torch_module(w), example_inputs=example
    )


def build_torchscript(path: Path, w: dict[str, np.ndarray]) -> Path:
    import torch  # lazy: a framework, imported only by the build that needs it

    from neuropod_torchscript.packager import create_torchscript_neuropod  # lazy: pulls in torch

    module = torch.jit.script(_torch_module(w))
    return create_torchscript_neuropod(path, "mlp", INPUT_SPEC, OUTPUT_SPEC, module=module)


def build_jax(path: Path, w: dict[str, np.ndarray]) -> Path:
    import jax  # lazy: a framework, imported only by the build that needs it
    import jax.numpy as jnp  # lazy: as jax

    from neuropod_jax.packager import create_jax_neuropod  # lazy: pulls in jax

    def mlp(params: dict[str, Any], x: Any) -> dict[str, Any]:
        scores = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        return {"scores": scores, "label": jnp.argmax(scores, axis=-1).astype(jnp.int32)}

    del jax
    return create_jax_neuropod(path, "mlp", INPUT_SPEC, OUTPUT_SPEC, fn=mlp, params=w)


def build_tensorflow(path: Path, w: dict[str, np.ndarray]) -> Path:
    from neuropod_tensorflow._quiet import import_tensorflow  # lazy: pulls in TensorFlow
    from neuropod_tensorflow.packager import create_tensorflow_neuropod  # lazy: as above

    tf = import_tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        hidden = tf.tanh(tf.matmul(x, tf.constant(w["w1"])) + tf.constant(w["b1"]))
        scores = tf.add(tf.matmul(hidden, tf.constant(w["w2"])), tf.constant(w["b2"]), name="scores")
        tf.argmax(scores, axis=-1, output_type=tf.int32, name="label")
    return create_tensorflow_neuropod(
        path,
        "mlp",
        INPUT_SPEC,
        OUTPUT_SPEC,
        node_name_mapping={"x": "x", "scores": "scores", "label": "label"},
        graph_def=graph.as_graph_def(),
    )


def build(framework: str, directory: Path, perturb: bool = False) -> Path:
    w = weights(perturb)
    path = Path(directory) / f"{framework}{'_perturbed' if perturb else ''}.neuropod"
    if framework == "onnx":
        return build_onnx(path, w, test_data=not perturb)
    builders = {
        "torch_export": build_torch_export,
        "torchscript": build_torchscript,
        "jax": build_jax,
        "tensorflow": build_tensorflow,
    }
    return builders[framework](path, w)


if __name__ == "__main__":
    args = sys.argv[1:]
    perturb = "--perturb" in args
    framework, directory = [a for a in args if a != "--perturb"]
    if framework not in FRAMEWORKS:
        sys.exit(f"build_package.py: unknown framework {framework!r}: one of {', '.join(FRAMEWORKS)}")
    print(build(framework, Path(directory), perturb))
