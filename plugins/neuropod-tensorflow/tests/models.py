"""Small TensorFlow models the tests build: frozen graphs, SavedModels, Keras."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf


def adder_graph_def() -> tf.compat.v1.GraphDef:
    """A frozen graph: out = x + y, doubled = out * 2 (float32 [None, 2]); joined = a + " " + b (strings)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="in/x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 2], name="in/y")
        total = tf.add(x, y, name="out/total")
        tf.multiply(total, 2.0, name="out/doubled")
        a = tf.compat.v1.placeholder(tf.string, [None], name="in/a")
        b = tf.compat.v1.placeholder(tf.string, [None], name="in/b")
        tf.strings.join([a, b], separator=" ", name="out/joined")
    return graph.as_graph_def()


ADDER_MAPPING = {
    "x": "in/x",
    "y": "in/y:0",
    "out": "out/total",
    "doubled": "out/doubled:0",
}
STRINGS_MAPPING = {"a": "in/a", "b": "in/b", "joined": "out/joined"}


class Scaler(tf.Module):
    """A SavedModel-able module: y = x * scale + shift, with a serving_default signature."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = tf.Variable(3.0)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x"), tf.TensorSpec([None], tf.float32, name="shift")])
    def serving_default(self, x: tf.Tensor, shift: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": x * self.scale + shift, "label": tf.strings.as_string(x)}


def scalar_graph_def() -> tf.compat.v1.GraphDef:
    """A frozen graph on 0-d tensors: scaled = x * 2.5, text = str(x)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [], name="x")
        tf.multiply(x, 2.5, name="scaled")
        tf.strings.as_string(x, precision=1, name="text")
    return graph.as_graph_def()


class ScalarModule(tf.Module):
    """A SavedModel-able module on 0-d tensors, as scalar_graph_def."""

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="x")])
    def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"scaled": x * 2.5, "text": tf.strings.as_string(x, precision=1)}


def counter_graph_def() -> tf.compat.v1.GraphDef:
    """An unfrozen graph whose variable needs its init op: out = x * v (v = 2), init op ``init``."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        v = tf.compat.v1.Variable(2.0, name="v", use_resource=False)
        tf.multiply(x, v, name="out")
        tf.compat.v1.variables_initializer([v], name="init")
    return graph.as_graph_def()


def save_without_serving_default(path: Path) -> Path:
    module = tf.Module()
    module.f = tf.function(lambda x: {"y": x}, input_signature=[tf.TensorSpec([None], tf.float32)])
    tf.saved_model.save(module, str(path), signatures={"other": module.f.get_concrete_function()})
    return path


def keras_model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(4,), name="features")
    hidden = tf.keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = tf.keras.layers.Dense(2, name="scores")(hidden)
    return tf.keras.Model(inputs, outputs)


def keras_two_in_two_out() -> tf.keras.Model:
    """Inputs a, b ([None, 2]); outputs sum = a + b, diff = a - b; given and returned as dicts."""
    a = tf.keras.Input((2,), name="a")
    b = tf.keras.Input((2,), name="b")
    total = tf.keras.layers.Add(name="sum")([a, b])
    diff = tf.keras.layers.Subtract(name="diff")([a, b])
    return tf.keras.Model(inputs={"b": b, "a": a}, outputs={"z_sum": total, "a_diff": diff})
