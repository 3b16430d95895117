"""Batching a package the original Neuropod wrote, whose output reuses the batch symbol at another size.

The original checked a spec symbol within the inputs and within the outputs
separately, so such a package runs there and here one request at a time; the
batcher must not turn that into failures once requests are merged. The model
is a real ONNX graph: y = concat(x, x), with the spec saying both are
``["batch_size"]``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import helper  # noqa: E402

from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry  # noqa: E402
from neuropod_serving.server.model_config import model_config  # noqa: E402

from conftest import onnx_package  # noqa: E402

Arrays = dict[str, np.ndarray]


def _original_doubler(models: Path) -> Path:
    """The doubler as the original Neuropod would have written it: no exported_with, no manifest."""
    path = onnx_package(models / "doubler", "doubler", [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)],
                        [("x", "float32", ["batch_size"])], [("y", "float32", ["batch_size"])])  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    del config["exported_with"]
    (path / "config.json").write_text(json.dumps(config, indent=4))
    (path / "manifest.json").unlink()
    return path


class _Held:
    """The model's real ``infer``, recording the rows of each run; the first run waits for ``release``."""

    def __init__(self, infer: Callable[..., Arrays]) -> None:
        self.infer = infer
        self.rows: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, inputs: Arrays, requested: list[str] | None = None) -> Arrays:
        self.rows.append(len(inputs["x"]))
        self.entered.set()
        if not self.release.wait(30):
            raise AssertionError("the test never released the held run")
        return self.infer(inputs, requested)


def test_original_package_whose_outputs_do_not_keep_the_rows_runs_unbatched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _original_doubler(tmp_path / "models")
    registry = ModelRegistry.load([tmp_path / "models"])
    served = registry.get("doubler")
    assert served.model.package.original_format
    held = _Held(served.model.infer)
    served.model.infer = held  # type: ignore[method-assign]  # the batcher binds it when the engine starts
    engine = Engine(registry, batching=BatchPolicy(8))
    try:
        assert engine.batched("doubler") == (True, "")  # "batch_size" leads every input and output
        assert model_config(engine, served)["max_batch_size"] == 8
        requests = [np.arange(i + 1, dtype=np.float32) + 10 * i for i in range(3)]
        with caplog.at_level(logging.WARNING, logger="neuropod_serving.server"), ThreadPoolExecutor(3) as pool:
            first = pool.submit(engine.infer_blocking, served, {"x": requests[0]})
            assert held.entered.wait(10), "the first run never started"
            rest = [pool.submit(engine.infer_blocking, served, {"x": x}) for x in requests[1:]]
            time.sleep(0.2)  # both reach the batcher while the first run holds its only slot
            held.release.set()
            answers = [f.result(30) for f in (first, *rest)]
        for x, got in zip(requests, answers):
            np.testing.assert_array_equal(got["y"], np.concatenate([x, x]))
        # The first alone; the other two merged (2 + 3 rows), whose output of 10 rows does not
        # split back, then each of them alone.
        assert held.rows == [1, 5, 2, 3]
        assert "does not bind outputs to the inputs' batch size" in caplog.text
        assert engine.batched("doubler")[0] is False
        assert "did not keep the batch's rows" in engine.batched("doubler")[1]
        # Its model configuration says so too: no batching, the batch dimension back in the dims.
        config = model_config(engine, served)
        assert config["max_batch_size"] == 0 and "dynamic_batching" not in config, config
        assert config["input"][0]["dims"] == [-1], config["input"]
        # From now on requests are never merged.
        held.rows.clear()
        with ThreadPoolExecutor(4) as pool:
            later = [np.full(2, i, np.float32) for i in range(4)]
            for x, f in zip(later, [pool.submit(engine.infer_blocking, served, {"x": x}) for x in later]):
                np.testing.assert_array_equal(f.result(30)["y"], np.concatenate([x, x]))
        assert held.rows == [2, 2, 2, 2]
    finally:
        held.release.set()
        engine.close()


def test_remote_model_of_an_original_package_checks_its_answers_by_the_original_rule(tmp_path: Path) -> None:
    """The server says the package binds symbols per side; the client's output check follows it."""
    import neuropod
    from neuropod.testing import served

    _original_doubler(tmp_path / "models")
    x = np.arange(3, dtype=np.float32)
    with served(tmp_path / "models") as server:
        for url in (f"grpc://{server.grpc}/doubler", f"{server.http}/doubler"):
            with neuropod.load_neuropod(url, timeout=10) as remote:
                np.testing.assert_array_equal(remote.infer({"x": x})["y"], np.concatenate([x, x]))
