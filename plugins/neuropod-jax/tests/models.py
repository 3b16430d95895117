"""Small real JAX models the tests package: plain functions and weights as pytrees of numpy arrays."""

from __future__ import annotations

import itertools
from typing import Any

import jax.numpy as jnp
import numpy as np


def mlp_params(sizes: tuple[int, ...] = (3, 16, 16, 2), seed: int = 0) -> dict[str, Any]:
    """An MLP's weights: ``{"layers": [{"w", "b"}, ...], "scale": ()}``, float32."""
    rng = np.random.default_rng(seed)
    layers = [
        {"w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), "b": rng.standard_normal(b).astype(np.float32)}
        for a, b in itertools.pairwise(sizes)
    ]
    return {"layers": layers, "scale": np.float32(0.5)}


def mlp(params: dict[str, Any], x: Any) -> dict[str, Any]:
    """``{"y": the MLP's output, "norm": its row norms}``."""
    h = x
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i < len(params["layers"]) - 1:
            h = jnp.tanh(h)
    y = h * params["scale"]
    return {"y": y, "norm": jnp.sqrt(jnp.sum(y * y, axis=-1))}


def mlp_numpy(params: dict[str, Any], x: np.ndarray) -> dict[str, np.ndarray]:
    """The same MLP in numpy alone, as an independent reference."""
    h = x.astype(np.float64)
    layers = params["layers"]
    for i, layer in enumerate(layers):
        h = h @ layer["w"].astype(np.float64) + layer["b"].astype(np.float64)
        if i < len(layers) - 1:
            h = np.tanh(h)
    y = h * float(params["scale"])
    return {"y": y, "norm": np.sqrt((y * y).sum(-1))}


def copy_fn(names: list[str]) -> Any:
    """A function returning ``{"out_<s>": in_<s>}`` for the inputs named ``in_<s>``, positional in that order."""

    def fn(*xs: Any) -> dict[str, Any]:
        return {"out_" + n[len("in_"):]: jnp.asarray(x) for n, x in zip(names, xs)}

    return fn
