"""Both platforms served by ``neuropod serve`` (a real process): called over plain Open Inference
Protocol JSON, and loaded back as remote models over HTTP and gRPC. Needs
``neuropod-serving[server]``; skipped where it is not installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.packagers import create_aoti_neuropod, create_torch_export_neuropod
from neuropod.testing import oip_infer, served

import models
from conftest import TWO_LAYER_OUT, XY_SPEC, two_layer_direct, xy

pytest.importorskip("neuropod_serving.server", reason="neuropod-serving[server] is not installed")
pytest.importorskip("grpc", reason="neuropod-serving[client] is not installed")


def test_served_over_http_and_grpc(tmp_path: Path, two_layer_aoti: Path) -> None:
    root = tmp_path / "models"
    create_torch_export_neuropod(root / "exported", "exported", XY_SPEC, TWO_LAYER_OUT, module=models.TwoLayer(),
                                 example_inputs=xy(4))  # fmt: skip
    create_aoti_neuropod(root / "compiled", "compiled", XY_SPEC, TWO_LAYER_OUT,
                         compiled_package=two_layer_aoti / "0" / "data" / "model.pt2")  # fmt: skip
    inputs = xy(5, seed=5)
    want = two_layer_direct(**inputs)
    with served(root) as server:
        for name in ("exported", "compiled"):
            got = oip_infer(server.http, name, inputs)
            assert got["out"].dtype == np.float32 and got["out"].shape == (5, 3)
            np.testing.assert_allclose(got["out"], want["out"], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(got["norm"], want["norm"], rtol=1e-4, atol=1e-5)
            for url in (f"{server.http}/{name}", f"grpc://{server.grpc}/{name}"):
                with neuropod.load_neuropod(url) as model:
                    assert [s.name for s in model.outputs] == ["out", "norm"]
                    np.testing.assert_allclose(model.infer(inputs)["out"], want["out"], rtol=1e-4, atol=1e-5)
