"""The model behind ``neuropod demo python``: scikit-learn, from a process that need not have it.

The package holds a few lines of Python (``0/code/flower_model.py``), its
training data (``0/data/train.npz``) and ``requirements="scikit-learn"``,
which packaging locks to exact pins. Loading builds the lock's environment
once (a line per step on stderr) and runs the model in a worker from it. The
entrypoint fits a StandardScaler + LogisticRegression pipeline on the
packaged data when the model loads; a real package would ship a model
fitted beforehand instead (e.g. ``joblib.dump`` into ``data_paths``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

CODE = '''"""A two-class flower classifier: scikit-learn, fitted on the packaged data at load."""

import os

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def get_model(data_root):
    with np.load(os.path.join(data_root, "train.npz")) as data:
        pipeline = make_pipeline(StandardScaler(), LogisticRegression()).fit(data["x"], data["y"])

    def model(x):
        return {"label": pipeline.predict(x).astype(np.int64), "proba": pipeline.predict_proba(x)}

    return model
'''

INPUT_SPEC: list[dict[str, Any]] = [{"name": "x", "dtype": "float64", "shape": ["batch_size", 4]}]
OUTPUT_SPEC: list[dict[str, Any]] = [
    {"name": "label", "dtype": "int64", "shape": ["batch_size"]},
    {"name": "proba", "dtype": "float64", "shape": ["batch_size", 2]},
]


def build_demo(directory: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Package the demo model in ``directory``.

    :returns: the package path, inputs that fit, and inputs with 3 features
        instead of 4 (for showing a spec error).
    """
    import numpy as np

    # lazy: numpy (the packager imports it), kept out of importing this module (as numpy above)
    from neuropod_python.packager import create_python_neuropod

    rng = np.random.default_rng(0)
    # Two kinds of flower: four measurements each, around different means.
    x = np.concatenate([rng.normal([5.0, 3.4, 1.5, 0.2], 0.3, (30, 4)), rng.normal([6.5, 3.0, 5.5, 2.0], 0.3, (30, 4))])
    y = np.array([0] * 30 + [1] * 30)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="neuropod-demo-python-") as tmp:
        code, data = Path(tmp) / "code", Path(tmp) / "train.npz"
        code.mkdir()
        (code / "flower_model.py").write_text(CODE)
        np.savez(data, x=x, y=y)
        probe = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.1, 5.6, 2.1], [5.9, 3.0, 4.2, 1.5]])
        path = create_python_neuropod(
            directory / "demo_flowers", "demo_flowers", [{"path": data, "packaged_name": "train.npz"}],
            [{"python_root": code, "dirs_to_package": [""]}], "flower_model", "get_model", INPUT_SPEC, OUTPUT_SPEC,
            requirements="scikit-learn", default_input_tensor_device="CPU", test_input_data={"x": probe},
        )  # fmt: skip
    return path, {"x": probe}, {"x": probe[:, :3].copy()}


__all__ = ["CODE", "INPUT_SPEC", "OUTPUT_SPEC", "build_demo"]
