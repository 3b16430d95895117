"""``neuropod serve`` of a presigned package URL (an S3 signature and an Azure SAS token in its
query): neither shows in the server's log lines (a retried download's warnings), nor in the error
that ends a start whose download failed. A local web server serves a Python model (``y = x * 1``,
expected values from numpy). ``nox -s tests_storage`` installs what these need.
"""

from __future__ import annotations

import http.server
import io
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")
pytest.importorskip("fsspec", reason="needs neuropod[http] (nox -s tests_storage installs it)")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("httpx")

from neuropod import storage
from neuropod.cli import main
from versions_helpers import answer, build_scalers, expected, zip_of

from conftest import free_port, private_caches

SECRETS = ("AWSSIGSECRET", "AWSCREDSECRET", "SASSIGSECRET")
SIGNED = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AWSCREDSECRET%2F20260101%2Fus-east-1%2Fs3&"
          "X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature=AWSSIGSECRET&"
          "sv=2022-11-02&sr=b&sp=r&se=2030-01-01T00%3A00%3A00Z&sig=SASSIGSECRET")  # fmt: skip


class _Zip(http.server.BaseHTTPRequestHandler):
    """``/flaky.zip``: 500 to its first GET, then the package; ``/fail.zip``: the package's HEAD,
    500 to every GET; ``/denied.zip``: 403."""

    data: bytes
    flaky: list[int]
    protocol_version = "HTTP/1.1"

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        path = urlsplit(self.path).path
        status = {"/fail.zip": 200 if head else 500, "/denied.zip": 403}.get(path, 200)
        if path == "/flaky.zip" and not head and self.flaky:
            self.flaky.pop()
            status = 500
        self.send_response(status)
        self.send_header("Content-Length", str(len(self.data)) if status == 200 else "0")
        self.send_header("ETag", '"v1"')
        self.end_headers()
        if status == 200 and not head:
            self.wfile.write(self.data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-serve-secrets-test-"))
    with private_caches(root):
        data = zip_of(build_scalers(root / "stage", (1,))[1], root / "scaler.zip").read_bytes()
    handler = type("Zip", (_Zip,), {"data": data, "flaky": [1]})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        shutil.rmtree(root, ignore_errors=True)


def _no_secret(text: str) -> None:
    found = [s for s in SECRETS if s in text]
    assert not found, f"{found} in: {text}"


def test_a_failed_start_shows_no_signature(
    web: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(storage.transfer, "FIRST_WAIT_S", 0.01)
    caplog.set_level(logging.INFO)
    for name in ("fail", "denied"):
        argv = ["serve", f"{web}/{name}.zip?{SIGNED}", "--http-port", str(free_port()), "--grpc-port", "0",
                "--metrics-port", "0"]  # fmt: skip
        assert main(argv, out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert "neuropod serve: error: " in err and f"{web}/{name}.zip" in err, err
        _no_secret(err)
    assert any("retrying" in r.getMessage() and "/fail.zip" in r.getMessage() for r in caplog.records), caplog.text
    _no_secret(caplog.text)


def test_a_served_presigned_url_logs_no_signature(web: str, tmp_path: Path) -> None:
    """The command in its own process, its log lines as an operator sees them: the first GET fails
    and is retried (a warning), then the model serves."""
    import httpx

    port = free_port()
    with private_caches(tmp_path):
        proc = subprocess.Popen(
            [sys.executable, "-m", "neuropod", "serve", f"{web}/flaky.zip?{SIGNED}", "--http-port", str(port),
             "--grpc-port", "0", "--metrics-port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert answer(client) == ("1", expected(1))
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "retrying" in output and f"{web}/flaky.zip" in output, output
    _no_secret(output)
