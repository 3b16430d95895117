"""``preprocess_inception_ensemble``, the model of Triton's ``ensemble_image_client.py``, built two ways.

Triton's example repository chains ``image_preprocess`` (raw image file bytes -> the float image)
and ``inception_v3_graphdef`` (the image -> 1001 class scores with labels) as an ensemble
(``platform: "ensemble"``, ``max_batch_size`` above 0, one BYTES input ``INPUT`` [1], one FP32
output ``OUTPUT`` [1001] with labels). The same interface here, small:

- ``image_preprocess`` (:data:`PREPROCESS`): a Python-backend package. ``INPUT`` bytes
  [batch, 1] (each element a whole JPEG, or any file Pillow reads) -> ``OUTPUT`` float32
  [batch, :data:`SIZE`, :data:`SIZE`, 3]: decoded to RGB, resized to SIZE x SIZE (bilinear), scaled
  to [-1, 1] as Inception's preprocessing does (``x / 127.5 - 1``).
- ``inception_onnx`` (:data:`CLASSIFIER`): an ONNX graph with Inception's tensor names, not its
  network: ``input`` float32 [batch, SIZE, SIZE, 3] (NHWC) -> means over a 4 x 4 grid of blocks
  per channel (48 features) -> a dense layer of fixed random weights -> softmax ->
  ``InceptionV3/Predictions/Softmax`` float32 [batch, :data:`CLASSES`], labelled
  (:data:`LABELS`, ``output_labels`` of the package).

:func:`ensemble_repository` writes the repository either way (``via``):

- ``"pipeline"``: ``preprocess_inception_ensemble`` is one pipeline package of the two steps (its
  ``OUTPUT`` labelled too), and the only model of the repository;
- ``"config"``: the two step packages are the repository, and :func:`triton_config` is Triton's
  ensemble configuration (its JSON form) that makes ``preprocess_inception_ensemble`` of them when
  sent with a repository load: ``POST /v2/repository/models/preprocess_inception_ensemble/load``
  with ``{"parameters": {"config": json.dumps(triton_config())}}``.

Batching must be on when served (``--max-batch-size`` above 1): the example sends as many images
as the model's ``max_batch_size`` lets it, and none when that is 0.

This module imports nothing of the tests' own (the bench's ``triton_examples.py`` imports it too).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
from onnx import ModelProto, TensorProto, checker, helper

from neuropod.packagers import create_onnx_neuropod, create_pipeline_neuropod, create_python_neuropod

Via = Literal["pipeline", "config"]

ENSEMBLE = "preprocess_inception_ensemble"
PREPROCESS = "image_preprocess"
CLASSIFIER = "inception_onnx"
#: The classifier's tensor names (Triton's Inception v3 graph's).
CLASSIFIER_IN = "input"
CLASSIFIER_OUT = "InceptionV3/Predictions/Softmax"
#: The side of the square image the classifier takes, and its grid of pooled blocks.
SIZE = 64
GRID = 4
#: Classes, as Inception v3's (ImageNet's 1000 and a background class).
CLASSES = 1001
#: Each class's label (no ':', which the classification answer's fields are split on).
LABELS = ["BACKGROUND", *(f"class_{i:04d}" for i in range(1, CLASSES))]

#: ``image_preprocess``'s code.
PREPROCESS_SOURCE = f'''
import io

import numpy as np
from PIL import Image

SIZE = {SIZE}


def preprocess(INPUT):
    """Each image file of INPUT [batch, 1] decoded, resized and scaled: [batch, SIZE, SIZE, 3] float32."""
    images = []
    for data in INPUT.reshape(len(INPUT)).tolist():
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        images.append(np.asarray(rgb, dtype=np.float32) / 127.5 - 1.0)
    return {{"OUTPUT": np.stack(images) if images else np.zeros((0, SIZE, SIZE, 3), np.float32)}}


def get_model(data_root):
    return preprocess
'''


def _spec(name: str, dtype: str, shape: list[Any]) -> list[dict[str, Any]]:
    return [{"name": name, "dtype": dtype, "shape": shape}]


def classifier_weights() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The dense layer's weights [48, CLASSES] and bias [CLASSES] (fixed: seeded)."""
    rng = np.random.default_rng(45)
    features = 3 * GRID * GRID
    return (
        rng.standard_normal((features, CLASSES)).astype(np.float32) * np.float32(0.5),
        rng.standard_normal(CLASSES).astype(np.float32) * np.float32(0.1),
    )


def classifier_onnx() -> ModelProto:
    """The classifier's ONNX graph (IR 8, opset 17): NHWC -> NCHW, block means, dense, softmax."""
    weights, bias = classifier_weights()
    block = SIZE // GRID
    nodes = [
        helper.make_node("Transpose", [CLASSIFIER_IN], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("AveragePool", ["nchw"], ["blocks"], kernel_shape=[block, block], strides=[block, block]),
        helper.make_node("Flatten", ["blocks"], ["features"], axis=1),
        helper.make_node("MatMul", ["features", "weights"], ["product"]),
        helper.make_node("Add", ["product", "bias"], ["logits"]),
        helper.make_node("Softmax", ["logits"], [CLASSIFIER_OUT], axis=-1),
    ]
    inits = [
        helper.make_tensor("weights", TensorProto.FLOAT, list(weights.shape), weights.ravel().tolist()),
        helper.make_tensor("bias", TensorProto.FLOAT, list(bias.shape), bias.tolist()),
    ]
    graph = helper.make_graph(
        nodes, "inception_like",
        [helper.make_tensor_value_info(CLASSIFIER_IN, TensorProto.FLOAT, ["batch", SIZE, SIZE, 3])],
        [helper.make_tensor_value_info(CLASSIFIER_OUT, TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    checker.check_model(model)
    return model


def write_preprocess(dest: Path) -> Path:
    """``image_preprocess`` as a Python-backend package at ``dest`` (its code written in a temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="image-preprocess-code-") as code:
        (Path(code) / "image_preprocess_model.py").write_text(PREPROCESS_SOURCE)
        path: Path = create_python_neuropod(
            dest, PREPROCESS, [], [{"python_root": code, "dirs_to_package": [""]}], "image_preprocess_model",
            "get_model", _spec("INPUT", "bytes", ["batch", 1]), _spec("OUTPUT", "float32", ["batch", SIZE, SIZE, 3]),
        )  # fmt: skip
    return path


def write_classifier(dest: Path) -> Path:
    """``inception_onnx`` as an ONNX package at ``dest``, its output labelled."""
    path: Path = create_onnx_neuropod(
        dest, CLASSIFIER, input_spec=_spec(CLASSIFIER_IN, "float32", ["batch", SIZE, SIZE, 3]),
        output_spec=_spec(CLASSIFIER_OUT, "float32", ["batch", CLASSES]), onnx_model=classifier_onnx(),
        output_labels={CLASSIFIER_OUT: LABELS},
    )  # fmt: skip
    return path


def write_pipeline(dest: Path) -> Path:
    """``preprocess_inception_ensemble`` as one pipeline package at ``dest`` (the steps built beside it
    in a temporary folder, then copied in)."""
    with tempfile.TemporaryDirectory(prefix="inception-ensemble-steps-") as scratch:
        preprocess = write_preprocess(Path(scratch) / PREPROCESS)
        classifier = write_classifier(Path(scratch) / CLASSIFIER)
        path: Path = create_pipeline_neuropod(
            dest, ENSEMBLE,
            steps=[
                {"package": str(preprocess), "input_map": {"INPUT": "INPUT"},
                 "output_map": {"OUTPUT": "preprocessed_image"}},
                {"package": str(classifier), "input_map": {CLASSIFIER_IN: "preprocessed_image"},
                 "output_map": {CLASSIFIER_OUT: "OUTPUT"}},
            ],
            input_spec=_spec("INPUT", "bytes", ["batch", 1]),
            output_spec=_spec("OUTPUT", "float32", ["batch", CLASSES]),
            output_labels={"OUTPUT": LABELS},
        )  # fmt: skip
    return path


def triton_config(max_batch_size: int = 8) -> dict[str, Any]:
    """Triton's ensemble configuration of ``preprocess_inception_ensemble`` over the two served step
    models (the JSON form of its ``config.pbtxt``; BYTES is TYPE_STRING in a Triton configuration)."""
    return {
        "name": ENSEMBLE,
        "platform": "ensemble",
        "max_batch_size": max_batch_size,
        "input": [{"name": "INPUT", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "OUTPUT", "data_type": "TYPE_FP32", "dims": [CLASSES]}],
        "ensemble_scheduling": {
            "step": [
                {"model_name": PREPROCESS, "model_version": -1, "input_map": {"INPUT": "INPUT"},
                 "output_map": {"OUTPUT": "preprocessed_image"}},
                {"model_name": CLASSIFIER, "model_version": -1, "input_map": {CLASSIFIER_IN: "preprocessed_image"},
                 "output_map": {CLASSIFIER_OUT: "OUTPUT"}},
            ]
        },
    }  # fmt: skip


def ensemble_repository(models: Path, via: Via = "pipeline") -> list[str]:
    """Write the models of ``via`` into the repository ``models``; returns the names it serves."""
    models.mkdir(parents=True, exist_ok=True)
    if via == "pipeline":
        write_pipeline(models / ENSEMBLE)
        return [ENSEMBLE]
    write_preprocess(models / PREPROCESS)
    write_classifier(models / CLASSIFIER)
    return [PREPROCESS, CLASSIFIER]


__all__ = [
    "CLASSES",
    "CLASSIFIER",
    "CLASSIFIER_IN",
    "CLASSIFIER_OUT",
    "ENSEMBLE",
    "LABELS",
    "PREPROCESS",
    "SIZE",
    "classifier_onnx",
    "classifier_weights",
    "ensemble_repository",
    "triton_config",
    "write_classifier",
    "write_pipeline",
    "write_preprocess",
]
