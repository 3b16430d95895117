"""A JAX package served by ``neuropod serve`` (a real process): called over plain Open Inference
Protocol JSON, and loaded back as a remote model over HTTP and gRPC. Needs
``neuropod-serving[server]``; skipped where it is not installed."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import neuropod
from neuropod.packagers import create_jax_neuropod
from neuropod.testing import oip_infer, served

import models
from conftest import spec

pytest.importorskip("neuropod_serving.server", reason="neuropod-serving[server] is not installed")
pytest.importorskip("grpc", reason="neuropod-serving[client] is not installed")


def test_served_over_http_and_grpc(tmp_path: Path) -> None:
    params = models.mlp_params()
    create_jax_neuropod(
        tmp_path / "models" / "mlp", "mlp", spec(("x", "float32", ["batch", 3])),
        spec(("y", "float32", ["batch", 2]), ("norm", "float32", ["batch"])), fn=models.mlp, params=params,
    )  # fmt: skip
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    want = {k: np.asarray(v) for k, v in jax.jit(models.mlp)(params, x).items()}
    with served(tmp_path / "models") as server:
        got = oip_infer(server.http, "mlp", {"x": x})
        assert got["y"].dtype == np.float32 and got["y"].shape == (4, 2)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["norm"], want["norm"], rtol=1e-6, atol=1e-6)
        for url in (f"{server.http}/mlp", f"grpc://{server.grpc}/mlp"):
            with neuropod.load_neuropod(url) as model:
                assert [s.name for s in model.outputs] == ["y", "norm"]
                np.testing.assert_allclose(model.infer({"x": x})["y"], want["y"], rtol=1e-6, atol=1e-6)
