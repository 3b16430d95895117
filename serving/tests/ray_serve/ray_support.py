"""What the Ray Serve tests share: the adder package, tritonclient in its own venv, raw REST and
gRPC calls, Ray's per-replica metrics, and waiting for replicas.

Not a conftest.py: a second conftest.py under serving/tests would take the name ``conftest``
from serving/tests/conftest.py, which the other serving tests import helpers from.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serving/tests: the shared package builders
from conftest import ADDER_IN, ADDER_OUT, onnx_package

DRIVER = Path(__file__).with_name("triton_driver.py")
#: The python of a venv with tritonclient[http,grpc] and numpy (nox -s tests_ray makes it).
TRITON_PYTHON = os.environ.get("NEUROPOD_TEST_TRITON_PYTHON")
needs_triton = pytest.mark.skipif(
    not TRITON_PYTHON,
    reason="NEUROPOD_TEST_TRITON_PYTHON is unset: tritonclient needs a venv of its own "
    "(protobuf < 7, Ray needs 7); nox -s tests_ray makes one",
)


def adder_package(dest: Path, name: str = "adder") -> Path:
    """A zip package of the adder (out = x + y, doubled = 2 * out; FP32 of shape [batch_size, 2])."""
    from onnx import TensorProto, helper

    return onnx_package(
        dest, name,
        [helper.make_node("Add", ["x", "y"], ["out"]), helper.make_node("Mul", ["out", "two"], ["doubled"])],
        ADDER_IN, ADDER_OUT, [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])], package_as_zip=True,
    )  # fmt: skip


def adder_inputs(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal((rows, 2)).astype(np.float32) for k in ("x", "y")}


def check_adder(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    """The adder's outputs for ``inputs``, computed here with numpy."""
    expected = inputs["x"] + inputs["y"]
    np.testing.assert_allclose(outputs["out"], expected, rtol=1e-6)
    np.testing.assert_allclose(outputs["doubled"], 2 * expected, rtol=1e-6)


def rest_body(inputs: dict[str, np.ndarray]) -> bytes:
    return json.dumps({"inputs": [
        {"name": k, "datatype": "FP32", "shape": list(v.shape), "data": v.ravel().tolist()} for k, v in inputs.items()
    ]}).encode()  # fmt: skip


def http(url: str, body: bytes | None = None, *, timeout: float = 30) -> tuple[int, bytes]:
    """The status and body of a GET (or, with ``body``, a JSON POST) to ``url``; error statuses included."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, body, headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def rest_outputs(body: bytes) -> dict[str, np.ndarray]:
    reply = json.loads(body)
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in reply["outputs"]}


def grpc_method(channel: Any, method: str, request_class: Any = None, response_class: Any = None) -> Any:
    """A unary call of ``inference.GRPCInferenceService``; without classes it sends and returns bytes."""
    from neuropod_serving.server.grpc_service import SERVICE

    return channel.unary_unary(
        f"/{SERVICE}/{method}",
        request_serializer=request_class.SerializeToString if request_class is not None else None,
        response_deserializer=response_class.FromString if response_class is not None else None,
    )


def run_triton(tmp: Path, calls: list[dict[str, Any]], arrays: dict[str, np.ndarray], *,
               http_port: int | None = None, grpc_port: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # fmt: skip
    """Run ``calls`` with tritonclient in its venv (triton_driver.py); what each returned, and the output arrays."""
    assert TRITON_PYTHON, "run_triton needs NEUROPOD_TEST_TRITON_PYTHON (use @needs_triton)"
    plan = tmp / "plan.json"
    np.savez(tmp / "inputs.npz", **arrays)
    plan.write_text(json.dumps({
        "http_url": f"127.0.0.1:{http_port}" if http_port else None,
        "grpc_url": f"127.0.0.1:{grpc_port}" if grpc_port else None,
        "inputs": str(tmp / "inputs.npz"),
        "calls": calls,
    }))  # fmt: skip
    done = subprocess.run([TRITON_PYTHON, str(DRIVER), str(plan)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"triton_driver.py failed:\n{done.stdout}{done.stderr}"
    results = json.loads((tmp / "plan.result.json").read_text())
    with np.load(tmp / "plan.npz") as npz:
        outputs = {k: npz[k] for k in npz.files}
    return results, outputs


# -- Ray ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve_cluster(http_port: int, grpc_port: int, **init: Any) -> Iterator[None]:
    """A fresh local Ray cluster (``ray.init(**init)``, no dashboard; another module's cluster in
    this process is shut down first) with Serve's proxies on ``http_port`` and ``grpc_port``; Serve
    and the cluster shut down after."""
    import ray
    from ray import serve

    from neuropod_serving import ray as neuropod_ray

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    ray.init(include_dashboard=False, **init)
    try:
        neuropod_ray.start(http_port=http_port, grpc_port=grpc_port)
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_states(app: str) -> dict[str, int]:
    """How many replicas of ``app``'s deployment are in each state (RUNNING, STARTING, ...)."""
    from ray import serve

    from neuropod_serving.ray import DEPLOYMENT_NAME

    status = serve.status().applications.get(app)
    if status is None or DEPLOYMENT_NAME not in status.deployments:
        return {}
    return {str(k): int(v) for k, v in status.deployments[DEPLOYMENT_NAME].replica_states.items()}


def wait_running(app: str, replicas: int, seconds: float) -> float:
    """Wait until exactly ``replicas`` replicas of ``app`` run and none is starting; the seconds it took."""
    start = time.monotonic()
    states: dict[str, int] = {}
    while time.monotonic() - start < seconds:
        states = replica_states(app)
        if states.get("RUNNING", 0) == replicas and sum(states.values()) == replicas:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{app!r} did not have {replicas} running replicas within {seconds:g} s: {states}")


def replica_infos(app: str, replicas: int, seconds: float = 60) -> dict[str, dict[str, Any]]:
    """``info()`` of every replica of ``app`` by replica id, asked through a handle until ``replicas`` answered."""
    from ray import serve

    handle = serve.get_app_handle(app)
    infos: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + seconds
    while len(infos) < replicas:
        assert time.monotonic() < deadline, f"only {sorted(infos)} of {replicas} replicas of {app!r} answered info()"
        info = handle.info.remote().result(timeout_s=30)
        infos[info["replica"]] = info
    return infos


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Ray's metrics export on ``port``: sample name -> [(labels, value)], neuropod's series only."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, f"Ray's metrics export on port {port} answered {status}"
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if "neuropod_" in s.name:
                samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return samples


def by_label(samples: Iterable[tuple[dict[str, str], float]], key: str, **match: str) -> dict[str, float]:
    """The values of ``samples`` whose labels include ``match``, summed by label ``key``."""
    out: dict[str, float] = {}
    for labels, value in samples:
        if all(labels.get(k) == v for k, v in match.items()):
            out[labels.get(key, "")] = out.get(labels.get(key, ""), 0.0) + value
    return out
