"""`neuropod serve` as a real process: TLS, the metrics port, access logs and --quiet, flag checks.

Servers are real ``python -m neuropod serve`` processes on free ports (gRPC
off: its interop has its own tests), stopped with SIGTERM. TLS uses a
self-signed certificate made here with the openssl command, and is checked
with clients nobody here wrote (tritonclient.http, httpx) that verify it.
Start-up errors must be one line on stderr naming the flag, with exit status 2.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import adder_and_echo, free_port, private_caches  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for certificates")


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    """The adder and echo packages, a self-signed certificate for 127.0.0.1/localhost with its key,
    a second key, the certificate in DER, and a private cache."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-serve-cli-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=False)
        for name, cn in (("", "localhost"), ("other-", "other")):
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                 "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-days", "1",
                 "-keyout", str(root / f"{name}key.pem"), "-out", str(root / f"{name}cert.pem")],
                check=True, capture_output=True,
            )  # fmt: skip
        subprocess.run(["openssl", "x509", "-in", str(root / "cert.pem"), "-outform", "DER", "-out",
                        str(root / "cert.der")], check=True, capture_output=True)  # fmt: skip
        yield root
    shutil.rmtree(root, ignore_errors=True)


# --- helpers ----------------------------------------------------------------------------------


def _serve_cmd(repo: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "neuropod", "serve", str(repo / "models"), *args]


def _fails(repo: Path, *args: str) -> str:
    """Run ``neuropod serve`` expecting a start-up error: exit 2, nothing served; its stderr."""
    r = subprocess.run(_serve_cmd(repo, *args), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "serving" not in r.stdout, r.stdout
    return r.stderr


@dataclass
class _Proc:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    port: int
    metrics_port: int

    def logs(self) -> tuple[str, str]:
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")


def _start(repo: Path, tmp: Path, *extra: str, verify: Any = None) -> _Proc:
    """Start a server (gRPC off, metrics on a free port) and wait until it answers; output goes to files."""
    port, metrics_port = free_port(), free_port()
    out, err = tmp / "stdout", tmp / "stderr"
    cmd = _serve_cmd(repo, "--http-port", str(port), "--grpc-port", "0", "--metrics-port", str(metrics_port), *extra)
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=dict(os.environ))
    served = _Proc(proc, out, err, port, metrics_port)
    scheme = "https" if verify is not None else "http"
    deadline = time.monotonic() + 30
    with httpx.Client(verify=verify if verify is not None else True, timeout=1) as http:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"neuropod serve exited with {proc.returncode} before it was ready: {served.logs()}")
            try:
                if http.get(f"{scheme}://127.0.0.1:{port}/v2/health/ready").status_code == 200:
                    return served
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                _stop(served)
                pytest.fail(f"neuropod serve was not ready within 30 s: {served.logs()}")
            time.sleep(0.1)


def _stop(served: _Proc) -> tuple[str, str]:
    """SIGTERM it and wait (kill after 10 s, which fails the test); its stdout and stderr."""
    served.proc.send_signal(signal.SIGTERM)
    try:
        served.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait()
        pytest.fail(f"neuropod serve did not exit within 10 s of SIGTERM: {served.logs()}")
    assert served.proc.returncode in (0, -signal.SIGTERM), served.logs()
    return served.logs()


def _xy(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(batch)
    return rng.standard_normal((batch, 2)).astype(np.float32), rng.standard_normal((batch, 2)).astype(np.float32)


def _triton_adder(client: Any, batch: int) -> None:
    x, y = _xy(batch)
    inputs = [httpclient.InferInput(n, [batch, 2], "FP32") for n in "xy"]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    result = client.infer("adder", inputs)
    np.testing.assert_allclose(result.as_numpy("doubled"), (x + y) * 2, rtol=1e-6)


def _json_adder(http: Any, base: str, batch: int) -> None:
    x, y = _xy(batch)
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [batch, 2], "data": a.ravel().tolist()}
                       for n, a in (("x", x), ("y", y))]}  # fmt: skip
    r = http.post(f"{base}/v2/models/adder/infer", json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    np.testing.assert_allclose(out["out"], x + y, rtol=1e-6)


def _requests_total(text: str, model: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "neuropod_requests_total" and s.labels == {"model": model, "protocol": "rest"}:
                return float(s.value)
    return 0.0


# --- a plain server: the metrics port and the access log -----------------------------------------


def test_metrics_port_and_access_log(repo: Path, tmp_path: Path) -> None:
    served = _start(repo, tmp_path)
    rest, metrics = f"http://127.0.0.1:{served.port}", f"http://127.0.0.1:{served.metrics_port}"
    try:
        with httpx.Client(timeout=10) as http:
            for batch in (1, 2, 3):
                _json_adder(http, rest, batch)
            for _ in range(4):
                assert http.get(f"{rest}/v2/models/echo/ready").status_code == 200
            # The metrics port: GET /metrics only, the same counters as the REST port's /metrics.
            r = http.get(f"{metrics}/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert _requests_total(r.text, "adder") == 3
            assert _requests_total(http.get(f"{rest}/metrics").text, "adder") == 3
            for path in ("/v2/health/ready", "/v2", "/v2/models/adder", "/", "/metrics/x"):
                r = http.get(f"{metrics}{path}")
                assert r.status_code == 404, (path, r.text)
                assert f"port {served.metrics_port} serves only GET /metrics" in r.json()["error"]
            r = http.post(f"{metrics}/v2/models/adder/infer", json={})
            assert r.status_code == 404, r.text
            assert http.post(f"{metrics}/metrics").status_code == 405
    finally:
        out, err = _stop(served)
    logs = out + err
    # The start-up lines name every listener.
    assert f"REST http://127.0.0.1:{served.port}/v2" in out, out
    assert f"metrics http://127.0.0.1:{served.metrics_port}/metrics" in out, out
    # One access-log line per request, with its status.
    infer_lines = [line for line in logs.splitlines() if '"POST /v2/models/adder/infer HTTP/1.1" 200' in line]
    assert len(infer_lines) == 3, logs
    assert len([line for line in logs.splitlines() if '"GET /v2/models/echo/ready HTTP/1.1" 200' in line]) == 4, logs
    assert len([line for line in logs.splitlines() if '"GET /metrics/x HTTP/1.1" 404' in line]) == 1, logs


# --- TLS ----------------------------------------------------------------------------------------


def test_tls_quiet(repo: Path, tmp_path: Path) -> None:
    cert = str(repo / "cert.pem")
    trust = ssl.create_default_context(cafile=cert)
    served = _start(repo, tmp_path, "--tls-cert", cert, "--tls-key", str(repo / "key.pem"), "--quiet", verify=trust)
    url = f"127.0.0.1:{served.port}"
    try:
        # tritonclient.http, verifying the server against our certificate (hostname included).
        client = httpclient.InferenceServerClient(url, ssl=True, ssl_options={"ca_certs": cert}, insecure=False)
        try:
            assert client.is_server_ready()
            assert client.get_model_metadata("adder")["inputs"][0]["shape"] == [-1, 2]
            for batch in (1, 5):
                _triton_adder(client, batch)
        finally:
            client.close()
        # The system's trust store does not know a self-signed certificate: verification is real.
        strict = httpclient.InferenceServerClient(url, ssl=True, insecure=False)
        try:
            with pytest.raises(Exception, match="(?i)certificate"):
                strict.is_server_ready()
        finally:
            strict.close()
        with httpx.Client(verify=trust, timeout=10) as http:
            _json_adder(http, f"https://{url}", 2)
            _json_adder(http, f"https://localhost:{served.port}", 3)
            # The metrics port speaks TLS too.
            r = http.get(f"https://127.0.0.1:{served.metrics_port}/metrics")
            assert r.status_code == 200 and _requests_total(r.text, "adder") == 4
        with httpx.Client(timeout=5) as http, pytest.raises(httpx.ConnectError, match="(?i)certificate"):
            http.get(f"https://{url}/v2/health/ready")  # not trusted without the certificate
        # Plain HTTP to a TLS port gets no HTTP answer.
        for port in (served.port, served.metrics_port):
            with httpx.Client(timeout=5) as http:
                try:
                    r = http.get(f"http://127.0.0.1:{port}/v2/health/ready")
                except httpx.TransportError:
                    pass
                else:
                    pytest.fail(f"plain HTTP on TLS port {port} was answered: {r.status_code} {r.text!r}")
            plain = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                # geventhttpclient: the connection closes without an HTTP reply.
                with pytest.raises((InferenceServerException, OSError, HTTPException)):
                    plain.is_server_ready()
            finally:
                plain.close()
        # Still serving after the failed handshakes.
        with httpx.Client(verify=trust, timeout=10) as http:
            assert http.get(f"https://{url}/v2/health/live").status_code == 200
    finally:
        out, err = _stop(served)
    # --quiet: no table, no "serving" line, no access log.
    assert out == "", out
    assert "HTTP/1.1" not in err and "MODEL" not in err, err


def test_tls_flag_errors(repo: Path, tmp_path: Path) -> None:
    cert, key = str(repo / "cert.pem"), str(repo / "key.pem")
    port = str(free_port())
    base = ("--http-port", port, "--grpc-port", "0", "--metrics-port", "0")

    err = _fails(repo, *base, "--tls-cert", cert)
    assert (
        err.strip()
        == "neuropod serve: error: --tls-cert needs --tls-key too: TLS takes a certificate and its private key"
    )
    err = _fails(repo, *base, "--tls-key", key)
    assert err.strip().startswith("neuropod serve: error: --tls-key needs --tls-cert too"), err

    cases = {
        # A DER certificate: refused by name before anything starts.
        ("--tls-cert", str(repo / "cert.der"), "--tls-key", key): f"--tls-cert {repo / 'cert.der'} is not PEM",
        ("--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", key): f"--tls-cert {tmp_path / 'missing.pem'}: cannot read it",
        ("--tls-cert", cert, "--tls-key", str(repo / "other-key.pem")): (
            f"--tls-key {repo / 'other-key.pem'} is not the private key of --tls-cert {cert}"
        ),
        ("--tls-cert", cert, "--tls-key", cert): f"--tls-key {cert} holds no readable PEM private key",
    }  # fmt: skip
    garbled = tmp_path / "garbled.pem"
    garbled.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n")
    cases[("--tls-cert", str(garbled), "--tls-key", key)] = f"--tls-cert {garbled} holds no readable PEM certificate"
    for args, message in cases.items():
        err = _fails(repo, *base, *args)
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("neuropod serve: error: ") and message in err, (args, err)


def test_encrypted_key_is_an_error_not_a_prompt(repo: Path, tmp_path: Path) -> None:
    key = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", str(repo / "key.pem"), "-aes256", "-passout", "pass:secret",
                    "-out", str(key)], check=True, capture_output=True)  # fmt: skip
    err = _fails(repo, "--grpc-port", "0", "--metrics-port", "0", "--http-port", str(free_port()),
                 "--tls-cert", str(repo / "cert.pem"), "--tls-key", str(key))  # fmt: skip
    assert f"--tls-key {key} is encrypted" in err, err


# --- ports --------------------------------------------------------------------------------------


def test_same_port_twice_is_an_error(repo: Path) -> None:
    p = str(free_port())
    err = _fails(repo, "--http-port", p, "--grpc-port", "0", "--metrics-port", p)
    assert f"--http-port {p}, --grpc-port 0 and --metrics-port {p} must differ" in err, err
    err = _fails(repo, "--http-port", p, "--grpc-port", p, "--metrics-port", "0")
    assert "must differ" in err and "--grpc-port" in err, err


@pytest.mark.parametrize(
    ("flag", "what", "off"),
    [
        ("--http-port", "REST", ""),
        ("--grpc-port", "gRPC", " (0 turns gRPC off)"),
        ("--metrics-port", "metrics", " (0 turns it off; /metrics stays on the REST port)"),
    ],
)
def test_port_in_use_names_the_flag(repo: Path, flag: str, what: str, off: str) -> None:
    """One line of ours (no grpcio log line), the port, the flag that changes it; exit 2 (_fails)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        ports = {"--http-port": str(free_port()), "--grpc-port": str(free_port()), "--metrics-port": str(free_port())}
        ports[flag] = str(taken)
        args = [a for f, p in ports.items() for a in (f, p)]
        err = _fails(repo, *args, "--quiet")
    assert err == (
        f"neuropod serve: error: {flag} {taken}: the {what} port 127.0.0.1:{taken} is already in use (by another "
        f"server?); stop that server, or choose a free port with {flag} PORT{off}\n"
    )


def test_a_busy_port_fails_before_the_models_load(tmp_path: Path) -> None:
    """Loading can take minutes: the port is checked first (here the package is not even there)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "neuropod", "serve", str(tmp_path / "missing"), "--http-port", str(taken),
             "--grpc-port", "0", "--metrics-port", "0", "--quiet"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    assert r.stderr.startswith(f"neuropod serve: error: --http-port {taken}: the REST port 127.0.0.1:{taken} is already"), r.stderr


def test_an_address_not_of_this_machine_names_host(repo: Path) -> None:
    err = _fails(repo, "--host", "999.1.1.1", "--http-port", str(free_port()), "--grpc-port", "0", "--quiet")
    assert err.startswith("neuropod serve: error: --host 999.1.1.1: cannot listen on 999.1.1.1:"), err
    assert err.endswith("; give a name or address of this machine, e.g. 127.0.0.1, or 0.0.0.0 for all\n"), err
    assert len(err.splitlines()) == 1


# --- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--max-batch-size", "0"), "argument --max-batch-size: must be at least 1, not 0"),
        (("--max-batch-size", "-3"), "argument --max-batch-size: must be at least 1, not -3"),
        (("--max-batch-size", "many"), "argument --max-batch-size: 'many' is not a whole number"),
        (("--max-batch-size", "2.5"), "argument --max-batch-size: '2.5' is not a whole number"),
        (("--max-queue-delay-us", "-1"), "argument --max-queue-delay-us: must be 0 to 10,000,000 microseconds"),
        (("--max-queue-delay-us", "1e3"), "argument --max-queue-delay-us: '1e3' is not a whole number of microseconds"),
        (("--max-queue-delay-us", "10000001"), "argument --max-queue-delay-us: must be 0 to 10,000,000"),
        (("--http-port", "0"), "argument --http-port: must be at least 1, not 0"),
        (("--http-port", "70000"), "argument --http-port: a port is 1 to 65535, not 70000"),
        (("--metrics-port", "-1"), "argument --metrics-port: must be at least 1, not -1"),
        (("--grpc-port", "http"), "argument --grpc-port: 'http' is not a whole number"),
        (("--workers", "0"), "argument --workers: must be at least 1, not 0"),
        (("--max-request-bytes", "0"), "argument --max-request-bytes: must be at least 1, not 0"),
    ],
)
def test_argument_checks(repo: Path, args: tuple[str, str], message: str) -> None:
    """argparse's usage error (exit 2) with the flag and what it takes; nothing starts."""
    err = _fails(repo, "--grpc-port", "0", "--metrics-port", "0", *args)
    assert "usage: neuropod serve" in err, err
    assert f"neuropod serve: error: {message}" in err, err


def test_batching_flags_are_accepted(repo: Path, tmp_path: Path) -> None:
    """Valid values start a server that batches adder (it has a batch dim) and says so."""
    served = _start(repo, tmp_path, "--max-batch-size", "8", "--max-queue-delay-us", "0")
    try:
        with httpx.Client(timeout=10) as http:
            _json_adder(http, f"http://127.0.0.1:{served.port}", 3)
    finally:
        out, _ = _stop(served)
    adder = next(line for line in out.splitlines() if line.startswith("adder"))
    assert " yes " in f" {adder} ", out


def test_ctrl_c_under_ray_exits_when_ray_does_not_finish_stopping(tmp_path: Path) -> None:
    """`neuropod serve --ray` on Ctrl-C deletes its applications and disconnects, each within a
    bound: a Ray that never finishes (a controller going away with the process group) leaves a
    warning naming the applications and an exit, not a hung command. Ray itself is not needed
    to show it: the steps are whatever `serve.delete` and `ray.shutdown` do."""
    script = tmp_path / "stop.py"
    script.write_text(
        "import threading, types\n"
        "from neuropod_serving.launch import _leave_ray\n"
        "stuck = threading.Event()\n"
        "serve = types.SimpleNamespace(delete=lambda name: stuck.wait())\n"
        "ray = types.SimpleNamespace(shutdown=lambda: None)\n"
        "_leave_ray(serve, ray, ['adder', 'echo'], timeout_s=0.5)\n"
        "print('not reached')\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == 0, done.stderr
    assert "not reached" not in done.stdout
    assert "Ray did not finish deleting the applications in 0.5 s" in done.stderr
    assert "adder, echo" in done.stderr
