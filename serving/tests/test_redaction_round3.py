"""Signatures never reach a log line or an error of the server's repository poll or of remote
models, and a repository URL's query stays on each package URL under it.

- A polled repository: a version whose code fails naming the presigned URL it read its weights
  from is logged and listed with that URL redacted; a poll that fails outright logs its
  traceback redacted.
- Remote models: a URL holding a token (query, fragment, user information) is refused without
  it; a server's error that names a presigned URL reaches the caller with that URL redacted.
- A repository URL with a query (``s3://bucket/models?versionId=...``, an Azure SAS token): each
  package under it is fetched at ``<path>/<package>?<query>``, shown without the query.

Expected values are the URLs themselves, with or without their secret parts.
"""

from __future__ import annotations

import http.server
import json
import logging
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("httpx")

import neuropod
from neuropod.errors import RemoteError
from neuropod_serving.server import served_versions
from neuropod_serving.server.served_versions import RemoteRepository
from versions_helpers import answer, build_scalers, expected, index, place, serving, wait_for

from conftest import private_caches, python_package

POLL_S = 0.1
SECRET = "SECRET0123456789"
#: A presigned URL, as a model's code or a store's exception names it.
SIGNED = f"https://bucket.s3.amazonaws.com/weights.bin?X-Amz-Credential=AKIA%2Fx&X-Amz-Signature={SECRET}"
SHOWN = "https://bucket.s3.amazonaws.com/weights.bin"

#: Loads where it is packaged; where REDACTION_TEST_FAIL is set (the server), fails as a model whose
#: weights come from an expired presigned URL does.
FAILS_NAMING_A_SIGNED_URL = f"""
import os

def get_model(data_root):
    if os.environ.get("REDACTION_TEST_FAIL"):
        raise RuntimeError("cannot read the weights from {SIGNED}: 403")
    return lambda x: {{"y": x}}
"""


@pytest.fixture(scope="module")
def scalers() -> Iterator[dict[int, Path]]:
    """``scaler`` packages with K = 1 and 2, and one (key 0) whose load fails naming a signed URL."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-redaction3-test-"))
    with private_caches(root):
        built = build_scalers(root / "stage", (1, 2))
        built[0] = python_package(root / "stage" / "fails" / "scaler", "scaler", FAILS_NAMING_A_SIGNED_URL)
        yield built
    shutil.rmtree(root, ignore_errors=True)


# --- the repository poll ---------------------------------------------------------------------------


def test_a_load_failing_on_a_signed_url_is_logged_and_listed_redacted(
    tmp_path: Path, scalers: dict[int, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDACTION_TEST_FAIL", "1")
    repo = tmp_path / "models"
    place(scalers[1], repo / "scaler" / "1")
    caplog.set_level(logging.INFO, logger="neuropod_serving.server")
    with serving([repo], poll=POLL_S) as (_, http):
        assert answer(http) == ("1", expected(1))
        place(scalers[0], repo / "scaler" / "2")  # its load fails, naming a presigned URL
        wait_for(
            "version 2's failure to be listed", lambda: "last load failed" in index(http)[("scaler", "2")]["reason"]
        )
        reason = index(http)[("scaler", "2")]["reason"]
        assert answer(http) == ("1", expected(1))  # version 1 keeps serving
    assert SHOWN in reason and SECRET not in reason, reason
    failed = [r.getMessage() for r in caplog.records if "loading version 2 of model 'scaler' failed" in r.getMessage()]
    assert failed and SHOWN in failed[0], caplog.text
    assert SECRET not in caplog.text and "AKIA" not in caplog.text, caplog.text


def test_a_failed_poll_logs_its_traceback_redacted(
    tmp_path: Path, scalers: dict[int, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "models"
    place(scalers[1], repo / "scaler" / "1")
    caplog.set_level(logging.INFO, logger="neuropod_serving.server")
    with serving([repo], poll=POLL_S) as (engine, http):
        assert answer(http) == ("1", expected(1))

        def scan(**_: Any) -> Any:  # what a store's client raises: its exception names the URL it requested
            raise OSError(f"the store answered garbage for {SIGNED}")

        monkeypatch.setattr(engine.registry, "scan", scan)
        wait_for("the poll's failure to be logged", lambda: "polling the model repository failed" in caplog.text)
        monkeypatch.undo()
        assert answer(http) == ("1", expected(1))
        assert engine._poller is not None and engine._poller.is_alive()  # the poll goes on
    record = next(r for r in caplog.records if "polling the model repository failed" in r.getMessage())
    text = record.getMessage()
    assert "Traceback" in text and "OSError: the store answered garbage for " + SHOWN in text, text
    assert record.exc_info is None  # the traceback is the redacted text, not the exception's
    assert SECRET not in caplog.text and "AKIA" not in caplog.text, caplog.text


# --- remote models ---------------------------------------------------------------------------------


def _closed_port() -> int:
    """A port of 127.0.0.1 nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "form",
    ["http://127.0.0.1:{port}/model?sig={secret}", "grpc://127.0.0.1:{port}/model?X-Amz-Signature={secret}",
     "http://user:{secret}@127.0.0.1:{port}/model", "https://127.0.0.1:{port}/model#access_token={secret}"],
    ids=["query", "grpc-query", "user-info", "fragment"],
)  # fmt: skip
def test_a_remote_model_url_holding_a_token_is_refused_without_it(form: str) -> None:
    url = form.format(port=_closed_port(), secret=SECRET)
    for urls in (url, [f"http://127.0.0.1:{_closed_port()}/model", url]):
        with pytest.raises(ValueError) as info:
            neuropod.load_neuropod(urls)
        message = str(info.value)
        assert SECRET not in message, message
        assert "127.0.0.1" in message and "/model" in message, message


class _Failing(http.server.BaseHTTPRequestHandler):
    """A server whose model's metadata answers 500 with an error naming a presigned URL."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"error": f"model 'm' failed to load: downloading {SIGNED} answered 403"}).encode()
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def failing_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_servers_error_naming_a_signed_url_reaches_the_caller_redacted(failing_server: int) -> None:
    with pytest.raises(RemoteError) as info:
        neuropod.load_neuropod(f"http://127.0.0.1:{failing_server}/m", retries=0)
    e = info.value
    assert e.code == "internal", e
    assert SHOWN in str(e) and SECRET not in str(e) and "AKIA" not in str(e), str(e)
    assert e.server_message is not None and SECRET not in e.server_message, e.server_message


# --- a repository URL with a query -----------------------------------------------------------------


@pytest.mark.parametrize(
    "repository",
    ["s3://bucket/models?versionId=7", "s3://bucket/models/?versionId=7",
     "az://container/models?sv=2024-01-01&sig=" + SECRET],
)  # fmt: skip
def test_each_package_of_a_repository_url_with_a_query_keeps_it(
    repository: str, scalers: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's listing and downloads stand in for a bucket: the URLs asked for are what is checked."""
    listing = {"scaler/1/config.json": {"size": 10, "ETag": "a"}, "scaler/2/scaler.zip": {"size": 20, "ETag": "b"},
               "other.neuropod": {"size": 30, "ETag": "c"}}  # fmt: skip
    fetched: list[str] = []

    def list_objects(url: str, **_: Any) -> dict[str, Any]:
        assert url == repository
        return listing

    def fetch(url: str, **_: Any) -> Path:
        fetched.append(url)
        return scalers[1]

    monkeypatch.setattr(served_versions.storage, "list_objects", list_objects)
    monkeypatch.setattr(served_versions.storage, "fetch", fetch)
    found = RemoteRepository(repository).scan()
    path, query = repository.split("?")
    base = path.rstrip("/")
    assert sorted(fetched) == sorted(
        [f"{base}/other.neuropod?{query}", f"{base}/scaler/1/?{query}", f"{base}/scaler/2/scaler.zip?{query}"]
    )
    assert sorted(f.where for f in found) == sorted(
        [f"{base}/other.neuropod", f"{base}/scaler/1/", f"{base}/scaler/2/scaler.zip"]
    )
