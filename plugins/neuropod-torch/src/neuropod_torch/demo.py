"""The model behind ``neuropod demo torch``: a small classifier (Linear, ReLU, Linear, softmax), torch.export-ed.

The demo packages it for the ``torch_export`` platform only: compiling it with
AOTInductor as well would take it from about two seconds to twenty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuropod.plugins import import_framework

INPUT_SPEC: list[dict[str, Any]] = [{"name": "x", "dtype": "float32", "shape": ["batch_size", 4]}]
OUTPUT_SPEC: list[dict[str, Any]] = [
    {"name": "scores", "dtype": "float32", "shape": ["batch_size", 3]},
    {"name": "label", "dtype": "int64", "shape": ["batch_size"]},
]


def build_demo(directory: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Package the demo model in ``directory``.

    :returns: the package path, inputs that fit, and inputs of the wrong
        width (for showing a spec error).
    """
    import numpy as np

    # lazy: numpy (the packager imports it), kept out of importing this module (as numpy above)
    from neuropod_torch.packager import create_torch_export_neuropod

    import_framework("torch", "torch_export", "neuropod demo torch")
    import torch

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = torch.nn.Linear(4, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            scores = torch.softmax(self.out(torch.relu(self.hidden(x))), dim=-1)
            return {"scores": scores, "label": scores.argmax(dim=-1)}

    torch.manual_seed(0)
    module = Classifier().eval()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        expected = {k: v.numpy() for k, v in module(torch.from_numpy(x)).items()}
    path = create_torch_export_neuropod(
        Path(directory) / "demo_classifier.neuropod",
        "demo_classifier",
        INPUT_SPEC,
        OUTPUT_SPEC,
        module=module,
        test_input_data={"x": x},
        test_expected_out=expected,
    )
    return path, {"x": x}, {"x": np.ones((2, 5), dtype=np.float32)}
