"""Tensor names with '/', ':' and '.' on TorchScript packages: a forward that takes one dict keeps
any name; one that takes an argument per input cannot, and packaging says so, naming the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import neuropod
from neuropod.errors import NeuropodError
from neuropod.packagers import create_torchscript_neuropod

from conftest import spec

IN = "input/x:0"
OUT = "InceptionV3/Predictions/Softmax:0"


class ByDict(torch.nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Literals: TorchScript cannot read module-level strings.
        return {
            "InceptionV3/Predictions/Softmax:0": torch.softmax(inputs["input/x:0"], dim=-1),
            "out.1": inputs["in.1"] + 1,
        }


class ByArgument(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": x}


def test_names_with_slashes_colons_and_dots_through_a_dict(tmp_path: Path) -> None:
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    n = np.array([1, 2], np.int64)
    module = torch.jit.script(ByDict())
    path = create_torchscript_neuropod(
        tmp_path / "named", "named", spec((IN, "float32", ["batch", 4]), ("in.1", "int64", ["batch"])),
        spec((OUT, "float32", ["batch", 4]), ("out.1", "int64", ["batch"])), module=module,
        test_input_data={IN: x, "in.1": n},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        out = model.infer({IN: x, "in.1": n})
    with torch.no_grad():
        expected = module({IN: torch.from_numpy(x), "in.1": torch.from_numpy(n)})
    np.testing.assert_allclose(out[OUT], expected[OUT].numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out["out.1"], n + 1)


def test_a_name_that_cannot_be_an_argument_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(NeuropodError) as info:
        create_torchscript_neuropod(
            tmp_path / "bad", "bad", spec((IN, "float32", ["batch", 4])), spec(("y", "float32", ["batch", 4])),
            module=torch.jit.script(ByArgument()), test_input_data={IN: np.ones((1, 4), np.float32)},
        )  # fmt: skip
    message = str(info.value)
    assert f"'{IN}'" in message and "TorchScript" in message and "Dict[str, Tensor]" in message
    assert not (tmp_path / "bad").exists()
