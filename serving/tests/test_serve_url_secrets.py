"""``neuropod serve`` of a presigned package URL (an S3 signature and an Azure SAS token in its
query): neither shows in the server's log lines (a retried download's warnings), nor in the error
that ends a start whose download failed. A local web server serves a Python model (``y = x * 1``,
expected values from numpy). ``nox -s tests_storage`` installs what these need.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")
pytest.importorskip("fsspec", reason="needs neuropod[http] (nox -s tests_storage installs it)")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("httpx")

from neuropod import storage
from neuropod.cli import main
from versions_helpers import answer, build_scalers, expected, serve_command, zip_of

from conftest import free_port, private_caches

# The core tests' web server (core/tests/_web_server.py), loaded by its path: core/tests is not on sys.path here.
_spec = importlib.util.spec_from_file_location("_web_server", Path(__file__).parents[2] / "core/tests/_web_server.py")
assert _spec is not None and _spec.loader is not None
web_server = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = web_server  # where its dataclass looks itself up
_spec.loader.exec_module(web_server)

SECRETS = ("AWSSIGSECRET", "AWSCREDSECRET", "SASSIGSECRET")
SIGNED = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AWSCREDSECRET%2F20260101%2Fus-east-1%2Fs3&"
          "X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature=AWSSIGSECRET&"
          "sv=2022-11-02&sr=b&sp=r&se=2030-01-01T00%3A00%3A00Z&sig=SASSIGSECRET")  # fmt: skip


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    """``/flaky.zip``: 500 to its first GET, then the package; ``/fail.zip``: the package's HEAD,
    500 to every GET; ``/denied.zip``: 403. No byte ranges."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-serve-secrets-test-"))
    try:
        with private_caches(root):
            data = zip_of(build_scalers(root / "stage", (1,))[1], root / "scaler.zip").read_bytes()
        site = web_server.Site(files={"flaky.zip": data, "fail.zip": data}, status={"denied.zip": 403},
                               fail_gets={"fail.zip"}, flaky={"flaky.zip": 1}, etag='"v1"', ranges=False)  # fmt: skip
        with web_server.web_server(site) as base:
            yield base
    finally:
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

    with (
        private_caches(tmp_path),
        serve_command([f"{web}/flaky.zip?{SIGNED}"], free_port()) as served,
        httpx.Client(base_url=served.http, timeout=30) as client,
    ):
        assert answer(client) == ("1", expected(1))
    assert "retrying" in served.output and f"{web}/flaky.zip" in served.output, served.output
    _no_secret(served.output)
