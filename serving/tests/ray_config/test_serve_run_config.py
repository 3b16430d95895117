"""The issue's "done when": ``serve run`` with the example Serve config (serving/examples/ray-serve.yaml)
serves the quick start's package to tritonclient, over HTTP and gRPC.

Runs in a pytest process of its own, with no Ray cluster of its own: ``serve run`` starts one
(as a user's would) and stops it on Ctrl-C. tritonclient runs from its own venv
(``NEUROPOD_TEST_TRITON_PYTHON``; it pins protobuf < 7, Ray needs 7).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_procs import stop_with_ctrl_c

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")  # Ray Serve's own dependency

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "serving" / "examples" / "ray-serve.yaml"
TRITON_PYTHON = os.environ.get("NEUROPOD_TEST_TRITON_PYTHON")

# tritonclient's calls, run in its venv: metadata and one inference per protocol; prints JSON.
TRITON_SCRIPT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

http_url, grpc_url, model = sys.argv[1:4]
x = np.array([[1, 2], [3, 4]], np.float32)
y = np.array([[10, 20], [30, 40]], np.float32)
result = {}
for name, module, url in (("http", thttp, http_url), ("grpc", tgrpc, grpc_url)):
    client = module.InferenceServerClient(url)
    inputs = []
    for key, array in (("x", x), ("y", y)):
        tensor = module.InferInput(key, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    answer = client.infer(model, inputs)
    metadata = client.get_model_metadata(model) if name == "http" else client.get_model_metadata(model, as_json=True)
    result[name] = {
        "live": client.is_server_live(),
        "ready": client.is_model_ready(model),
        "inputs": sorted(t["name"] for t in metadata["inputs"]),
        "out": answer.as_numpy("out").tolist(),
    }
print(json.dumps(result))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, proc: subprocess.Popen[bytes], seconds: float) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/demo_adder/ready", timeout=2) as r:
                if json.loads(r.read()).get("ready"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"serve run did not serve demo_adder on port {port} within {seconds:g} s")


@pytest.mark.skipif(TRITON_PYTHON is None, reason="NEUROPOD_TEST_TRITON_PYTHON is unset (nox -s tests_ray makes that venv)")
def test_serve_run_with_the_example_config_serves_the_quick_start_package_to_tritonclient(tmp_path: Path) -> None:
    assert TRITON_PYTHON is not None
    serve_cli = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    assert serve_cli is not None, "Ray Serve's `serve` command is not installed"
    env = {**os.environ, "NEUROPOD_CACHE_DIR": str(tmp_path / "cache")}
    # The quick start's package, as its first command makes it.
    subprocess.run([sys.executable, "-m", "neuropod", "demo", "--dir", str(tmp_path / "models")],
                   check=True, env=env, capture_output=True)  # fmt: skip
    package = tmp_path / "models" / "demo_adder.neuropod"
    assert package.exists()

    # The example as it is, except the package path and the ports (free ones, not 8000/9000).
    config = yaml.safe_load(EXAMPLE.read_text())
    assert config["applications"][0]["import_path"] == "neuropod_serving.ray:app"
    assert "neuropod_serving.ray.add_inference_servicer" in config["grpc_options"]["grpc_servicer_functions"]
    http_port, grpc_port = _free_port(), _free_port()
    config["http_options"].update(port=http_port, host="127.0.0.1")
    config["grpc_options"]["port"] = grpc_port
    config["applications"][0]["args"]["package"] = str(package)
    # Two CPUs here: one replica of one CPU at a time leaves room for the proxy and controller.
    config["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] = 1
    path = tmp_path / "ray-serve.yaml"
    path.write_text(yaml.safe_dump(config))

    log = (tmp_path / "serve-run.log").open("wb")
    proc = subprocess.Popen([serve_cli, "run", str(path)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        _wait_http(http_port, proc, 180)
        done = subprocess.run(
            [TRITON_PYTHON, "-c", TRITON_SCRIPT, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", "demo_adder"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        x = np.array([[1, 2], [3, 4]], np.float32)
        y = np.array([[10, 20], [30, 40]], np.float32)
        expected = ((x + y) * 2).tolist()  # the demo model: out = (x + y) * 2
        for protocol in ("http", "grpc"):
            assert result[protocol] == {"live": True, "ready": True, "inputs": ["x", "y"], "out": expected}, protocol
    finally:
        stop_with_ctrl_c(proc, log)
    assert proc.returncode is not None
