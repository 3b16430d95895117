"""The model behind ``neuropod demo torchscript``: ``out = (x + y) * 2``, scripted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuropod.plugins import import_framework

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
    from neuropod_torchscript.packager import create_torchscript_neuropod

    import_framework("torch", "torchscript", "neuropod demo torchscript")
    import torch

    class AddTimesTwo(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": (x + y) * 2}

    x = np.array([[1, 2], [3, 4]], dtype=np.float32)
    y = np.array([[7, 8], [9, 10]], dtype=np.float32)
    path = create_torchscript_neuropod(
        Path(directory) / "demo_adder.neuropod",
        "demo_adder",
        INPUT_SPEC,
        OUTPUT_SPEC,
        module=torch.jit.script(AddTimesTwo()),
        platform_version_semver=">=2.0",
        test_input_data={"x": x, "y": y},
        test_expected_out={"out": (x + y) * 2},
    )
    return path, {"x": x, "y": y}, {"x": x, "y": np.ones((3, 2), dtype=np.float32)}
