"""A throwaway backend for core tests: the "model" is numpy code in this file.

It is registered in code (``neuropod.plugins.register``), the way llm's tests
register plugins, so the core can be tested with no framework installed.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from neuropod import hookimpl, plugins
from neuropod.backend import Backend, DeviceCaps
from neuropod.package import ModelConfig, parse_config, write_package

PLATFORM = "toy"


class ToyModel:
    def __init__(self, op: str) -> None:
        self.op = op
        self.closed = False

    def run(self, inputs: dict[str, np.ndarray], requested: list[str] | None) -> dict[str, np.ndarray]:
        if self.op == "add":
            out = {"out": inputs["x"] + inputs["y"]}
        elif self.op == "wrong_shape":
            out = {"out": np.zeros((inputs["x"].shape[0] + 1, 2), np.float32)}
        elif self.op == "raise":
            raise RuntimeError("toy framework exploded")
        elif self.op == "mapping":  # a read-only mapping, not a dict
            return types.MappingProxyType({"out": inputs["x"] + inputs["y"]})  # type: ignore[return-value]
        elif self.op == "list":  # not a mapping at all
            return [inputs["x"] + inputs["y"]]  # type: ignore[return-value]
        elif self.op == "float64":
            out = {"out": (inputs["x"] + inputs["y"]).astype(np.float64)}
        else:
            out = {"out": inputs["x"], "extra": inputs["x"]}
        return {k: v for k, v in out.items() if requested is None or k in requested}

    def close(self) -> None:
        self.closed = True


class ToyPlugin:
    """Offers toy 1.0.0 (CPU) and, when ``gpu`` is set, toy 2.0.0 (CPU + CUDA 12)."""

    def __init__(self, gpu: bool = False) -> None:
        self.gpu = gpu
        self.loaded: list[ToyModel] = []

    @hookimpl
    def supported_versions(self) -> list[Backend]:
        versions = [Backend(PLATFORM, "1.0.0", "toyframework")]
        if self.gpu:
            versions.append(Backend(PLATFORM, "2.0.0", "toyframework-gpu"))
        return versions

    @hookimpl
    def device_caps(self, backend: Backend) -> DeviceCaps | None:
        if backend.platform != PLATFORM:
            return None
        if backend.framework.endswith("-gpu"):
            return DeviceCaps(cpu=True, cuda="12.1")
        return DeviceCaps(cpu=True)

    @hookimpl
    def load_model(self, package: Any, backend: Backend, device: str, options: dict[str, Any]) -> Any:
        if backend.platform != PLATFORM:
            return None
        if options:
            from neuropod.errors import NeuropodError

            raise NeuropodError(f"toy backend takes no options, got {sorted(options)}")
        op = json.loads((package.data_dir / "op.json").read_text())["op"]
        model = ToyModel(op)
        self.loaded.append(model)
        return model

    @hookimpl
    def infer(self, model: Any, inputs: dict[str, np.ndarray], requested_outputs: list[str] | None) -> Any:
        return model.run(inputs, requested_outputs)


class ToyPluginWithDevice(ToyPlugin):
    """:class:`ToyPlugin` whose ``infer`` also takes ``output_device`` (as the ONNX and torch plugins' do)."""

    @hookimpl
    def infer(  # type: ignore[override]
        self, model: Any, inputs: dict[str, np.ndarray], requested_outputs: list[str] | None, output_device: str | None
    ) -> Any:
        assert output_device is None, "a CPU model's outputs are numpy arrays"
        return model.run(inputs, requested_outputs)


@contextlib.contextmanager
def toy_plugin(gpu: bool = False, with_device: bool = False) -> Iterator[ToyPlugin]:
    plugin = ToyPluginWithDevice(gpu) if with_device else ToyPlugin(gpu)
    assert plugins.register(plugin, "toy")
    try:
        yield plugin
    finally:
        plugins.unregister("toy")


ADD_CONFIG = {
    "name": "toy_adder",
    "platform": PLATFORM,
    "platform_version_semver": "*",
    "input_spec": [
        {"name": "x", "dtype": "float32", "shape": ["batch_size", 2]},
        {"name": "y", "dtype": "float32", "shape": ["batch_size", 2]},
    ],
    "output_spec": [{"name": "out", "dtype": "float32", "shape": ["batch_size", 2]}],
}


def write_toy(path: Path, op: str = "add", **overrides: Any) -> Path:
    config: ModelConfig = parse_config({**ADD_CONFIG, **overrides}, "toy config")
    x = np.array([[1, 2], [3, 4]], np.float32)
    y = np.array([[7, 8], [9, 10]], np.float32)
    return write_package(
        path,
        config,
        {"0/data/op.json": json.dumps({"op": op}).encode()},
        test_input_data={"x": x, "y": y},
        test_expected_out={"out": x + y},
    )
