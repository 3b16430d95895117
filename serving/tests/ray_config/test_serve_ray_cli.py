"""``neuropod serve PATH --ray``: every package under PATH as a Ray Serve application on a local
cluster the command starts (and stops on Ctrl-C); the builder's argument checks.

Runs in a pytest process with no Ray cluster of its own (the command makes one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_procs import stop_with_ctrl_c

import neuropod
from neuropod.errors import NeuropodError, PackageError
from neuropod_serving import ray as neuropod_ray

from conftest import adder_and_echo, free_port


def _get(url: str) -> tuple[int, Any]:
    """The status and JSON body (Ray's proxy answers routes with no application yet in plain text)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def _wait(url: str, proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"neuropod serve --ray exited with status {proc.returncode}")
        try:
            if _get(url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {seconds:g} s")


def test_serve_ray_deploys_every_package_and_routes_rest_and_grpc_by_model(tmp_path: Path) -> None:
    env = {**os.environ, "NEUROPOD_CACHE_DIR": str(tmp_path / "cache")}
    models = tmp_path / "models"
    os.environ["NEUROPOD_CACHE_DIR"] = str(tmp_path / "cache")
    adder_and_echo(models, echo_as_zip=True)
    http_port, grpc_port = free_port(), free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuropod", "serve", str(models), "--ray", "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--num-cpus", "0.5", "--max-batch-size", "4"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        # The command says when every application runs: adder at / (it sorts first), echo at /v2/models/echo.
        deadline = time.monotonic() + 180
        while "serving 2 model(s) on Ray Serve" not in (tmp_path / "serve.log").read_text(errors="replace"):
            assert proc.poll() is None, f"neuropod serve --ray exited with status {proc.returncode}"
            assert time.monotonic() < deadline, "neuropod serve --ray did not say it serves both models in 180 s"
            time.sleep(0.5)
        _wait(f"http://127.0.0.1:{http_port}/v2/models/echo/ready", proc, 60)
        _wait(f"http://127.0.0.1:{http_port}/v2/models/adder/ready", proc, 60)
        assert _get(f"http://127.0.0.1:{http_port}/v2/health/ready") == (200, {"ready": True})
        status, meta = _get(f"http://127.0.0.1:{http_port}/v2/models/echo")
        assert status == 200 and [t["name"] for t in meta["inputs"]] == ["n", "s"]
        assert _get(f"http://127.0.0.1:{http_port}/v2/models/echo/versions/2")[0] == 404

        x = np.array([[1, 2], [3, 4]], np.float32)
        y = np.array([[10, 20], [30, 40]], np.float32)
        n = np.array([5, -7], np.int64)
        s = np.array(["a", "héllo"], dtype=object)
        for scheme, port in (("http", http_port), ("grpc", grpc_port)):
            # Two applications: gRPC calls are routed by the 'application' metadata the client sends.
            with neuropod.load_neuropod(f"{scheme}://127.0.0.1:{port}/adder") as adder:
                out = adder.infer({"x": x, "y": y})
                np.testing.assert_array_equal(out["out"], x + y)
                np.testing.assert_array_equal(out["doubled"], (x + y) * 2)
                assert adder.backend.id.startswith("onnx==") and adder.device == "cpu"
            with neuropod.load_neuropod(f"{scheme}://127.0.0.1:{port}/echo") as echo:
                out = echo.infer({"n": n, "s": s})
                np.testing.assert_array_equal(out["n1"], n + 1)
                assert out["s_out"].tolist() == s.tolist()
    finally:
        stop_with_ctrl_c(proc, log, again_every=30)
    output = (tmp_path / "serve.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:]  # Ctrl-C: the applications deleted, the local cluster stopped


def test_serve_ray_refuses_options_it_cannot_honour(tmp_path: Path) -> None:
    env = {**os.environ, "NEUROPOD_CACHE_DIR": str(tmp_path / "cache")}
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    for extra, expected in (
        (["--ray", "--tls-cert", str(cert), "--tls-key", str(cert)], "not supported with --ray"),
        (["--ray", "--metrics-port", "9100"], "--metrics-port does not apply with --ray"),
        (["--replicas", "2"], "are options of --ray"),
        (["--address", "auto"], "is an option of --ray"),
    ):
        done = subprocess.run([sys.executable, "-m", "neuropod", "serve", str(tmp_path), *extra],
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode != 0
        assert expected in done.stderr, (extra, done.stderr)


def test_app_builder_names_what_is_wrong_before_touching_a_cluster(tmp_path: Path) -> None:
    with pytest.raises(NeuropodError, match="needs package=PATH"):
        neuropod_ray.app({})
    with pytest.raises(NeuropodError, match="does not take replicas"):
        neuropod_ray.app({"package": "p", "replicas": "2"})
    with pytest.raises(NeuropodError, match="max_batch_size='many' is not a valid max_batch_size"):
        neuropod_ray.app({"package": "p", "max_batch_size": "many"})
    with pytest.raises(NeuropodError, match="max_batch_size must be a whole number of at least 1, not 0"):
        neuropod_ray.app({"package": "p", "max_batch_size": "0"})
    with pytest.raises(ValueError, match="max_queue_delay_us must be at most"):
        neuropod_ray.build("p", max_queue_delay_us=20_000_000)
    with pytest.raises(ValueError, match="auth_token is empty"):
        neuropod_ray.build("p", auth_token="")


def test_package_bytes_zips_a_directory_deterministically_and_refuses_what_is_not_a_package(tmp_path: Path) -> None:
    import hashlib
    import zipfile

    os.environ["NEUROPOD_CACHE_DIR"] = str(tmp_path / "cache")
    adder_and_echo(tmp_path / "models", echo_as_zip=True)
    first = neuropod_ray.package_bytes(tmp_path / "models" / "adder")
    os.utime(tmp_path / "models" / "adder" / "config.json", (1, 1))  # a new mtime changes nothing
    assert hashlib.sha256(neuropod_ray.package_bytes(tmp_path / "models" / "adder")).digest() == hashlib.sha256(first).digest()
    with zipfile.ZipFile(__import__("io").BytesIO(first)) as zf:
        assert "config.json" in zf.namelist() and "manifest.json" in zf.namelist()
    # A zip package travels as its own bytes.
    assert neuropod_ray.package_bytes(tmp_path / "models" / "echo.zip") == (tmp_path / "models" / "echo.zip").read_bytes()
    with pytest.raises(PackageError, match="no such file or directory"):
        neuropod_ray.package_bytes(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(PackageError, match="is not a Neuropod package"):
        neuropod_ray.package_bytes(tmp_path / "plain")


def test_placement_from_the_package_and_the_package_store(tmp_path: Path) -> None:
    """A package that needs a GPU reserves one (unless overridden); a CPU model reserves `workers`
    CPUs; the store keeps one copy per distinct package, and a replica cannot fetch a forgotten one."""
    import asyncio
    import shutil

    import ray

    os.environ["NEUROPOD_CACHE_DIR"] = str(tmp_path / "cache")
    adder_and_echo(tmp_path / "models", echo_as_zip=True)
    gpu = tmp_path / "gpu_adder"
    shutil.copytree(tmp_path / "models" / "adder", gpu)
    config = json.loads((gpu / "config.json").read_text())
    config["device_requirements"] = {"device": "gpu"}  # what a TensorRT engine's package says
    (gpu / "config.json").write_text(json.dumps(config))

    ray.init(num_cpus=1, include_dashboard=False, namespace="placement-test")
    try:
        def actor_options(app: Any) -> dict[str, Any]:
            return dict(app._bound_deployment.ray_actor_options)  # what Serve will reserve per replica

        assert actor_options(neuropod_ray.build(gpu))["num_gpus"] == 1
        assert actor_options(neuropod_ray.build(gpu, ray_actor_options={"num_gpus": 0}))["num_gpus"] == 0
        cpu = actor_options(neuropod_ray.build(tmp_path / "models" / "adder", workers=3))
        assert cpu["num_cpus"] == 3 and not cpu.get("num_gpus")  # prefers a GPU, but the cluster has none

        first = neuropod_ray.publish(tmp_path / "models" / "echo.zip")
        again = neuropod_ray.publish(tmp_path / "models" / "echo.zip")
        assert first == again and first.name == "echo"
        store = ray.get_actor(neuropod_ray.STORE_NAME, namespace=neuropod_ray.STORE_NAMESPACE)
        assert first.digest in ray.get(store.digests.remote())
        fetched = asyncio.run(neuropod_ray.fetch(first))
        assert fetched.read_bytes() == (tmp_path / "models" / "echo.zip").read_bytes()

        fetched.unlink()  # not on this node any more, and not in the store either
        assert neuropod_ray.forget(first) and not neuropod_ray.forget(first)
        with pytest.raises(PackageError, match="no longer holds package 'echo'.*deploy the application again"):
            asyncio.run(neuropod_ray.fetch(first))
    finally:
        ray.shutdown()
