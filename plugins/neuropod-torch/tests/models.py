"""Small real PyTorch modules the tests export."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class CopyA(torch.nn.Module):
    def forward(self, in_a: Tensor) -> dict[str, Tensor]:
        return {"out_a": in_a}


class CopyAB(torch.nn.Module):
    def forward(self, in_a: Tensor, in_b: Tensor) -> dict[str, Tensor]:
        return {"out_a": in_a, "out_b": in_b}


class CopyABC(torch.nn.Module):
    def forward(self, in_a: Tensor, in_b: Tensor, in_c: Tensor) -> dict[str, Tensor]:
        return {"out_a": in_a, "out_b": in_b, "out_c": in_c}


COPIES = {1: CopyA, 2: CopyAB, 3: CopyABC}


class TwoLayer(torch.nn.Module):
    """A real little network: Linear, ReLU, Linear, plus a residual sum over a shared batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(4, 16)
        self.fc2 = torch.nn.Linear(16, 3)
        self.register_buffer("offset", torch.linspace(-1, 1, 3))

    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        h = torch.relu(self.fc1(x))
        return {"out": self.fc2(h) + y + self.offset, "norm": h.norm(dim=1)}


class Pair(NamedTuple):
    total: Tensor
    diff: Tensor


class ReturnsNamedTuple(torch.nn.Module):
    def forward(self, x: Tensor, y: Tensor) -> Pair:
        return Pair(x + y, x - y)


class ReturnsTensor(torch.nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 3


class ReturnsTuple(torch.nn.Module):
    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return x + y, x * y


class ReturnsTupleOfDicts(torch.nn.Module):
    def forward(self, x: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return {"twice": x * 2}, {"half": x / 2}


class ReturnsDuplicate(torch.nn.Module):
    def forward(self, x: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return {"out": x}, {"out": x * 2}


class Attention(torch.nn.Module):
    """Scores of queries against keys: batch and the two sequence lengths are three symbols,
    and the feature size a fourth, shared by q and k."""

    def forward(self, q: Tensor, k: Tensor) -> dict[str, Tensor]:
        scores = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return {"scores": scores}


class WithDefault(torch.nn.Module):
    def forward(self, x: Tensor, scale: float = 2.0, bias: Tensor | None = None) -> dict[str, Tensor]:
        out = x * scale
        if bias is not None:
            out = out + bias
        return {"out": out}


class KeywordOnly(torch.nn.Module):
    def forward(self, x: Tensor, *, y: Tensor) -> dict[str, Tensor]:
        return {"out": x - y}


class BranchOnValues(torch.nn.Module):
    """Branches on a tensor's values: torch.export cannot trace that."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        if x.sum() > 0:
            return {"y": x * 2}
        return {"y": x}


class FixedBatch(torch.nn.Module):
    """Works for a batch of 4 only (the reshape fixes it)."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": x.reshape(4, 3) * 2}


class Doubles(torch.nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": x * 2}


class Big(torch.nn.Module):
    """256 MiB of float32 weights: enough for NVML to see it come and go."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8192, 8192))

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": x @ self.w}


class WhereAreMyInputs(torch.nn.Module):
    """Adds x and y where x lives, and says where each input arrived (1 on a GPU, 0 on the CPU)."""

    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return {
            "out": x + y.to(x.device),
            "x_on_gpu": torch.tensor(int(x.is_cuda)),
            "y_on_gpu": torch.tensor(int(y.is_cuda)),
        }
