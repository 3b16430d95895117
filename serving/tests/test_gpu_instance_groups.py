"""A load with ``instance_group`` KIND_GPU moves a model onto the GPU it names, and KIND_CPU back.

A TorchScript model (torch's CUDA build is what a GPU machine most often has) is
served over gRPC and reloaded with tritonclient's ``load_model(config=...)`` as a
Triton user would; the model configuration, the device the model runs on and the
answers (computed here with numpy) are checked after each load. Marked ``gpu``:
skipped with the reason where there is no GPU or torch has no CUDA.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn")
grpcclient = pytest.importorskip("tritonclient.grpc")


try:  # TorchScript reads the model's source and annotations: it lives at module level
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]

if torch is not None:

    class Adder(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": x + y}


def _no_cuda_torch() -> str | None:
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU"
    return None


@pytest.mark.gpu(needs=_no_cuda_torch)
def test_kind_gpu_and_back_to_kind_cpu(tmp_path: Path) -> None:
    from neuropod.packagers import create_torchscript_neuropod
    from neuropod_serving.server import Engine, ModelRegistry
    from neuropod_serving.server.grpc_server import start_grpc_server

    spec = [{"name": n, "dtype": "float32", "shape": ["batch", 2]} for n in ("x", "y")]
    create_torchscript_neuropod(tmp_path / "models" / "adder", "adder", spec,
                                [{"name": "out", "dtype": "float32", "shape": ["batch", 2]}],
                                module=torch.jit.script(Adder()))  # fmt: skip
    engine = Engine(ModelRegistry.load([tmp_path / "models"]))
    grpc_server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((3, 2)).astype(np.float32) for _ in range(2))

    def answer() -> np.ndarray:
        inputs = [grpcclient.InferInput(n, [3, 2], "FP32") for n in ("x", "y")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(y)
        return client.infer("adder", inputs).as_numpy("out")

    try:
        for kind, device in (("KIND_GPU", "cuda:0"), ("KIND_CPU", "cpu")):
            group = {"kind": kind, "count": 1, **({"gpus": [0]} if kind == "KIND_GPU" else {})}
            client.load_model("adder", config=json.dumps({"instance_group": [group]}))
            assert engine.get("adder").model.device == device
            config = client.get_model_config("adder", as_json=True)["config"]
            assert config["instance_group"][0]["kind"] == kind, config["instance_group"]
            np.testing.assert_allclose(answer(), x + y, rtol=1e-6)
    finally:
        client.close()
        grpc_server.stop(None)
        engine.close()
        shutil.rmtree(tmp_path / "models", ignore_errors=True)
