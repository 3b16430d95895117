"""Triton's ``ensemble_image_client.py``, unchanged, against ``neuropod serve``.

The example (vendored byte for byte in triton_examples/, run as a subprocess over HTTP and gRPC)
reads the model's metadata and configuration (one input, its ``max_batch_size``), sends the raw
bytes of each image file of a folder (two JPEGs written here) as one BYTES batch [images, 1],
asks every output for its top classes (``class_count``) and prints them as ``score (index) =
label``. The model, ``preprocess_inception_ensemble`` (ensemble_models.py: a Pillow
preprocessing step and a small labelled ONNX classifier), is served two ways: one pipeline
package, and Triton's ensemble configuration sent with a repository load over its two served
steps. What it prints is checked against the classes computed here apart: the images decoded
with PIL and numpy, the classifier run by onnxruntime directly.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")
pytest.importorskip("onnx")
pytest.importorskip("neuropod_python")
pytest.importorskip("onnxruntime")
pytest.importorskip("PIL")

import onnxruntime as ort
from PIL import Image

from ensemble_models import (
    CLASSES,
    CLASSIFIER,
    ENSEMBLE,
    LABELS,
    PREPROCESS,
    SIZE,
    classifier_onnx,
    ensemble_repository,
    triton_config,
    write_pipeline,
)
from neuropod import load_neuropod
from neuropod.testing import served

from conftest import ExampleServer as Server
from conftest import private_caches

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "triton_examples" / "ensemble_image_client.py"
#: Classes the example is asked for (``-c``).
TOP = 3


def _jpeg(path: Path, width: int, height: int, seed: int) -> None:
    """A JPEG of coloured blocks (a 4 x 5 grid of random colours, scaled up)."""
    blocks = np.random.default_rng(seed).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    Image.fromarray(blocks).resize((width, height), Image.Resampling.NEAREST).save(path, "JPEG", quality=90)


@pytest.fixture(scope="module")
def images() -> Iterator[Path]:
    """A folder of two JPEGs of other sizes than the model's."""
    folder = Path(tempfile.mkdtemp(prefix="neuropod-ensemble-images-"))
    try:
        _jpeg(folder / "a.jpg", 80, 64, 1)
        _jpeg(folder / "b.jpg", 120, 90, 2)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", params=["pipeline", "config"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """``neuropod serve --max-batch-size 8`` over ``preprocess_inception_ensemble`` as a pipeline
    package ("pipeline"), or over its two steps, the ensemble loaded with Triton's configuration
    ("config")."""
    via = request.param
    root = Path(tempfile.mkdtemp(prefix=f"neuropod-triton-ensemble-{via}-"))
    try:
        with private_caches(root):
            ensemble_repository(root / "models", via=via)
            with served(root / "models", options=["--max-batch-size", "8"]) as where:
                s = Server(via, where.http, where.grpc)
                if via == "config":
                    body = {"parameters": {"config": json.dumps(triton_config())}}
                    status, text = s.post(f"/v2/repository/models/{ENSEMBLE}/load", body)
                    assert status == 200, f"load of {ENSEMBLE} with Triton's ensemble config: {status} {text}"
                yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _preprocessed(path: Path) -> np.ndarray[Any, Any]:
    """An image file as the classifier takes it: RGB, SIZE x SIZE (bilinear), scaled to [-1, 1], NHWC."""
    with Image.open(io.BytesIO(path.read_bytes())) as image:
        rgb = image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return (np.asarray(rgb, dtype=np.float32) / np.float32(127.5) - np.float32(1.0))[None]


def _scores(paths: list[Path]) -> np.ndarray[Any, Any]:
    """The classifier's scores [images, CLASSES], run by onnxruntime on the images preprocessed here."""
    session = ort.InferenceSession(classifier_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    batch = np.concatenate([_preprocessed(p) for p in paths])
    [scores] = session.run(None, {session.get_inputs()[0].name: batch})
    assert scores.shape == (len(paths), CLASSES)
    return np.asarray(scores)


def _expected(paths: list[Path]) -> dict[str, list[tuple[float, int, str]]]:
    """Each image's top classes, highest first: (score, index, label)."""
    out = {}
    for path, row in zip(paths, _scores(paths)):
        order = sorted(range(CLASSES), key=lambda i: (-float(row[i]), i))[:TOP]
        out[str(path)] = [(float(row[i]), i, LABELS[i]) for i in order]
    return out


def _printed(stdout: str) -> dict[str, list[tuple[float, int, str]]]:
    """What the example printed: per file, the classes under its one output ``[OUTPUT]``."""
    printed: dict[str, list[tuple[float, int, str]]] = {}
    for m in re.finditer(r'^"(.+)":\n  \[OUTPUT\]:\n((?:    .*\n)*)', stdout, re.MULTILINE):
        lines = m.group(2).splitlines()
        classes = [re.fullmatch(r"    (\S+) \((\d+)\) = (.*)", line) for line in lines]
        assert all(classes), lines
        printed[m.group(1)] = [(float(c.group(1)), int(c.group(2)), c.group(3)) for c in classes if c]
    return printed


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritons_ensemble_example_unchanged(server: Server, images: Path, protocol: str) -> None:
    """The example (``-i PROTOCOL -u URL -c 3 FOLDER``) exits 0 with PASS, having sent both images as
    one batch, and prints each one's top three classes as computed apart."""
    url = server.http.removeprefix("http://") if protocol == "http" else server.grpc
    command = [sys.executable, str(EXAMPLE), "-i", protocol, "-u", url, "-c", str(TOP), str(images)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "PASS" in proc.stdout.splitlines(), output[-3000:]
    assert "exceeds maximum batch size" not in proc.stdout  # both images fit in one request
    paths = sorted(images.iterdir())
    expected = _expected(paths)
    printed = _printed(proc.stdout)
    assert list(printed) == list(expected), proc.stdout
    for name, classes in expected.items():
        got = printed[name]
        assert [(i, label) for _, i, label in got] == [(i, label) for _, i, label in classes], (name, got, classes)
        # The server prints each score with six decimals.
        assert [s for s, _, _ in got] == pytest.approx([s for s, _, _ in classes], abs=1.5e-6), (name, got)
    assert len({printed[str(p)][0][1] for p in paths}) == 2  # the two images' best classes differ


def test_served_configuration(server: Server) -> None:
    """The configuration the example reads: one BYTES input [1] and one FP32 output [CLASSES] with
    batching (``max_batch_size`` 8, as the server's ``--max-batch-size``), an ensemble of the two
    steps' models in order."""
    config = server.get(f"/v2/models/{ENSEMBLE}/config")
    assert config["max_batch_size"] == 8, config
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [("INPUT", "TYPE_STRING", [1])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [("OUTPUT", "TYPE_FP32", [CLASSES])]
    assert config["platform"] == "ensemble", config
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == [PREPROCESS, CLASSIFIER], steps


def test_the_pipeline_in_process(tmp_path: Path, images: Path) -> None:
    """The pipeline package, loaded in process, answers the raw files' scores as onnxruntime does on
    the images preprocessed apart; its output carries the labels."""
    with private_caches(tmp_path):
        write_pipeline(tmp_path / ENSEMBLE)
        paths = sorted(images.iterdir())
        files = np.empty((len(paths), 1), dtype=object)
        files[:, 0] = [p.read_bytes() for p in paths]
        with load_neuropod(tmp_path / ENSEMBLE) as model:
            out = model.infer({"INPUT": files})
            labels = model.package.config.output_labels
    np.testing.assert_allclose(out["OUTPUT"], _scores(paths), rtol=1e-6, atol=1e-7)
    assert labels is not None and list(labels["OUTPUT"]) == LABELS
