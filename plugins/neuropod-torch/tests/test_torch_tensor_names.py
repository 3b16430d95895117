"""Tensor names with '/', ':' and '.' on torch.export packages: outputs are dict keys (any name
works); inputs are forward() parameters, so a name that is no identifier is refused clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import neuropod
from neuropod.errors import NeuropodError
from neuropod.packagers import create_torch_export_neuropod

from conftest import spec

OUT = "InceptionV3/Predictions/Softmax:0"


class Named(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {OUT: torch.softmax(x, dim=-1), "out.1": x * 2}


class Plain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": x}


def test_output_names_with_slashes_colons_and_dots(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    path = create_torch_export_neuropod(
        tmp_path / "named", "named", spec(("x", "float32", ["batch", 5])),
        spec((OUT, "float32", ["batch", 5]), ("out.1", "float32", ["batch", 5])), module=Named(),
        test_input_data={"x": x},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": x})
    with torch.no_grad():
        expected = Named()(torch.from_numpy(x))
    np.testing.assert_allclose(out[OUT], expected[OUT].numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out["out.1"], x * 2)


def test_an_input_name_forward_cannot_take_is_refused_naming_it_and_the_backend(tmp_path: Path) -> None:
    x = np.ones((2, 5), np.float32)
    with pytest.raises(NeuropodError) as info:
        create_torch_export_neuropod(
            tmp_path / "bad", "bad", spec(("input/x:0", "float32", ["batch", 5])), spec(("y", "float32", ["batch", 5])),
            module=Plain(), test_input_data={"input/x:0": x},
        )  # fmt: skip
    message = str(info.value)
    assert "'input/x:0'" in message and "create_torch_export_neuropod" in message and "identifiers" in message
    assert not (tmp_path / "bad").exists()
