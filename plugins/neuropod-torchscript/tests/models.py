"""Small PyTorch modules the tests script. They live in a file because
torch.jit.script reads their source."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Adder(torch.nn.Module):
    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {"out": x + y, "doubled": (x + y) * 2}


class DictAdder(torch.nn.Module):
    def forward(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"out": inputs["x"] + inputs["y"]}


class Upper(torch.nn.Module):
    def forward(self, inputs: dict[str, list[str]]) -> dict[str, list[str]]:
        return {"upper": [s.upper() for s in inputs["text"]]}


class SingleTensor(torch.nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 3


class Pair(NamedTuple):
    total: Tensor
    diff: Tensor


class ReturnsNamedTuple(torch.nn.Module):
    def forward(self, x: Tensor, y: Tensor) -> Pair:
        return Pair(x + y, x - y)


class ReturnsTupleOfDicts(torch.nn.Module):
    def forward(self, x: Tensor) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
        return {"twice": x * 2}, {"label": ["a" for _ in range(x.shape[0])]}


class ConcatStrings(torch.nn.Module):
    """Joins two string tensors element by element with a space; returns a bare List[str]."""

    def forward(self, x: list[str], y: list[str]) -> list[str]:
        return [a + " " + b for a, b in zip(x, y)]


class ReturnsDuplicate(torch.nn.Module):
    """Returns the output 'out' in both dicts of a tuple."""

    def forward(self, x: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return {"out": x, "a": x}, {"out": x * 2}


class Scalars(torch.nn.Module):
    """0-d in, 0-d out: the sum of a vector scaled by a scalar, and the vector's length."""

    def forward(self, x: Tensor, scale: Tensor) -> dict[str, Tensor]:
        return {"total": x.sum() * scale, "count": torch.tensor(x.shape[0])}


class OptionalBias(torch.nn.Module):
    def forward(self, x: Tensor, bias: Tensor | None = None) -> dict[str, Tensor]:
        if bias is None:
            return {"out": x}
        return {"out": x + bias}


class ReturnsInt(torch.nn.Module):
    def forward(self, x: Tensor) -> int:
        return x.shape[0]


class ReturnsListOfTensors(torch.nn.Module):
    def forward(self, x: Tensor) -> list[Tensor]:
        return [x]


class MissesAnOutput(torch.nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"a": x}


class Identity(torch.nn.Module):
    def forward(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"out_" + k[3:]: v for k, v in inputs.items()}


class Raises(torch.nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        if bool(x.sum() < 0):
            raise ValueError("negative input")
        return {"y": x}


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": self.fc(x)}


class StringIdentity(torch.nn.Module):
    """Copies every string input ``in_<s>`` to the output ``out_<s>`` (for the conformance suite)."""

    def forward(self, inputs: dict[str, list[str]]) -> dict[str, list[str]]:
        return {"out_" + k[3:]: v for k, v in inputs.items()}


class WhereAreMyInputs(torch.nn.Module):
    """Adds x and y where x lives, and says where each input arrived (1 on a GPU, 0 on the CPU)."""

    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {
            "out": x + y.to(x.device),
            "x_on_gpu": torch.tensor(int(x.is_cuda)),
            "y_on_gpu": torch.tensor(int(y.is_cuda)),
        }


class Big(torch.nn.Module):
    """256 MiB of float32 weights: enough for NVML to see it come and go."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8192, 8192))

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": x @ self.w}


class Subtract(torch.nn.Module):
    """Takes its arguments in the other order than the spec lists them: y first, then x."""

    def forward(self, y: Tensor, x: Tensor) -> dict[str, Tensor]:
        return {"diff": x - y}


class CountAndLabel(torch.nn.Module):
    """A dict of a tensor and a List[str] (Union values): numpy for both."""

    def forward(self, x: Tensor) -> dict[str, Tensor | list[str]]:
        out: dict[str, Tensor | list[str]] = {"n": torch.tensor(x.shape[0])}
        out["label"] = ["item" for _ in range(x.shape[0])]
        return out
