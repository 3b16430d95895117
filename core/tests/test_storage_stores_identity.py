"""Downloads from object stores whose nodes disagree: a load balancer in front of a real store
(moto's S3 server, gcp-storage-emulator, Azurite) that answers one range read of an object from
another version of the same size while every HEAD and listing still describes the first. The
download must fail saying the object changed and store nothing; loaded again, it downloads the
object whole. The objects are those no listed MD5 protects: an S3 multipart upload (its ETag is
not an MD5), a GCS object listed without ``md5Hash`` (a composite one), an Azure blob committed
from blocks (no Content-MD5).

The load balancer is a small HTTP proxy here: it forwards every request as it came (conditions
included) and sends the first range read of the object that does not start at byte 0 elsewhere.
gcp-storage-emulator neither honours ``ifGenerationMatch`` nor sends the ``x-goog-generation``
header Google's servers send with an object's bytes: the proxy adds that header (the generation of
the object it served), and the GCS test checks that the read was conditional and that the answer's
generation is checked. moto's server and Azurite honour ``If-Match``.

``nox -s tests_storage`` installs what these need; without it they skip.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import os
import random
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from neuropod import storage
from neuropod.errors import PackageError

MIB = 1024 * 1024
CHANGED = "changed while it was being downloaded"
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bytes(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _range_start(headers: dict[str, str]) -> int | None:
    value = headers.get("Range") or headers.get("range") or headers.get("x-ms-range") or ""
    return int(value[6:].partition("-")[0]) if value.startswith("bytes=") else None


class _Balancer:
    """An HTTP proxy on 127.0.0.1 in front of the store on ``port``: every request forwarded as it came
    (one connection each), except the first GET of ``path`` ranged past byte 0, which goes to
    ``other`` (a ``(port, path)``: another node, or another object), with ``drop`` headers left out.
    ``edit(path, headers, body)`` may change an answer; ``sent`` holds each request forwarded
    elsewhere (its path and headers)."""

    def __init__(self, port: int, path: str, other: tuple[int, str], *, drop: tuple[str, ...] = (),
                 edit: Callable[[str, list[tuple[str, str]], bytes], tuple[list[tuple[str, str]], bytes]] | None = None) -> None:  # fmt: skip
        self.port, self.path, self.other, self.drop, self.edit = port, path, other, drop, edit
        self.sent: list[tuple[str, dict[str, str]]] = []
        self.switched = False
        self.lock = threading.Lock()
        balancer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                balancer.forward(self)

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="test-balancer")
        self.thread.start()

    def forward(self, request: http.server.BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        headers = dict(request.headers.items())
        port, path = self.port, request.path
        start = _range_start(headers)
        with self.lock:
            if request.command == "GET" and path.partition("?")[0] == self.path and start and not self.switched:
                self.switched = True
                port, path = self.other[0], self.other[1] + path[len(self.path) :]
                headers = {k: v for k, v in headers.items() if k.lower() not in self.drop}
                self.sent.append((path, headers))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request(request.command, path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            out = [(k, v) for k, v in answer.getheaders() if k.lower() not in ("transfer-encoding", "connection")]
        finally:
            conn.close()
        if self.edit is not None:
            out, data = self.edit(path, out, data)
        request.close_connection = True
        request.send_response(answer.status, answer.reason)
        for k, v in out:
            if k.lower() != "content-length" or request.command == "HEAD":
                request.send_header(k, v)
        if request.command != "HEAD":
            request.send_header("Content-Length", str(len(data)))
        request.send_header("Connection", "close")
        request.end_headers()
        if request.command != "HEAD":
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a read given up (the download failed)
                request.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@contextlib.contextmanager
def _balancer(*args: Any, **kwargs: Any) -> Iterator[_Balancer]:
    balancer = _Balancer(*args, **kwargs)
    try:
        yield balancer
    finally:
        balancer.close()


def _nothing_stored() -> list[str]:
    """What the download cache holds besides its bookkeeping: downloads, partial ones, temporary ones."""
    root = storage.downloads_dir()
    return sorted(p.name for p in root.iterdir() if p.name not in ("urls", "locks")) if root.exists() else []


@pytest.fixture(autouse=True)
def _small_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Range reads of 1 MiB (a download reads objects larger than one in parallel ranges), a private cache."""
    monkeypatch.setattr(storage.stores, "CHUNK", MIB)
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))


# --- S3: moto's server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[Any, int]]:
    """moto's S3 server on 127.0.0.1 with a bucket: (a boto3 client, its port)."""
    pytest.importorskip("s3fs", reason="needs neuropod[s3] (nox -s tests_storage installs it)")
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (nox -s tests_storage installs it)")
    import boto3

    with pytest.MonkeyPatch.context() as mp:
        for k, v in AWS.items():
            mp.setenv(k, v)
        port = _free_port()
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
            client.create_bucket(Bucket="models")
            yield client, port
        finally:
            server.stop()


def _multipart(client: Any, key: str, parts: list[bytes]) -> str:
    """``parts`` uploaded as one multipart object: its ETag (``"...-N"``, not an MD5)."""
    upload = client.create_multipart_upload(Bucket="models", Key=key)["UploadId"]
    done = [{"PartNumber": n, "ETag": client.upload_part(Bucket="models", Key=key, UploadId=upload, PartNumber=n,
                                                         Body=part)["ETag"]} for n, part in enumerate(parts, 1)]  # fmt: skip
    etag = client.complete_multipart_upload(Bucket="models", Key=key, UploadId=upload,
                                            MultipartUpload={"Parts": done})["ETag"]  # fmt: skip
    assert etag.strip('"').endswith(f"-{len(parts)}"), etag
    return str(etag)


@pytest.mark.parametrize("store", ["honours If-Match", "ignores If-Match"])
def test_s3_a_range_read_answered_by_another_version_is_refused(s3: tuple[Any, int], store: str) -> None:
    """S3: each range read is conditional on the ETag (412 from a store that checks it) and its answer's
    ETag checked (a store or cache that ignores the condition): the download fails, nothing stored."""
    client, port = s3
    a = [_bytes(1, 5 * MIB), _bytes(2, MIB + 123)]  # multipart: parts of at least 5 MiB but the last
    b = [_bytes(3, 5 * MIB), _bytes(4, MIB + 123)]  # another version of the same size
    etag = _multipart(client, f"a-{store}.neuropod", a)
    _multipart(client, f"b-{store}.neuropod", b)
    key = f"a-{store}.neuropod".replace(" ", "%20")
    drop = ("if-match",) if store.startswith("ignores") else ()
    path, other = f"/models/{key}", f"/models/b-{store}.neuropod".replace(" ", "%20")
    with _balancer(port, path, (port, other), drop=drop) as balancer:
        options = {"client_kwargs": {"endpoint_url": balancer.url}}
        url = f"s3://models/a-{store}.neuropod"
        with pytest.raises(PackageError, match=CHANGED) as raised:
            storage.fetch(url, storage_options=options)
        assert balancer.switched and _nothing_stored() == [], _nothing_stored()
        if not drop:
            assert balancer.sent[0][1].get("If-Match") == etag, balancer.sent
            assert "another version" in str(raised.value), raised.value
        else:
            assert "ETag" in str(raised.value), raised.value
        # Loaded again (every node agreeing now): the object, whole.
        assert storage.fetch(url, storage_options=options).read_bytes() == b"".join(a)


# --- GCS: gcp-storage-emulator ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """gcp-storage-emulator on 127.0.0.1 with a bucket: its URL."""
    pytest.importorskip("gcsfs", reason="needs neuropod[gcs] (nox -s tests_storage installs it)")
    emulator = pytest.importorskip("gcp_storage_emulator.server", reason="needs gcp-storage-emulator")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        mp.setenv("CLOUDSDK_CONFIG", str(tmp_path_factory.mktemp("gcloud")))
        mp.setenv("NO_GCE_CHECK", "true")
        port = _free_port()
        server = emulator.create_server("127.0.0.1", port, in_memory=True)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            _post(f"{endpoint}/storage/v1/b?project=test", json.dumps({"name": "models"}).encode(), "application/json")
            yield endpoint
        finally:
            server.stop()


def _post(url: str, data: bytes, content_type: str) -> dict[str, Any]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=30) as r:
        return dict(json.loads(r.read()))


def _gcs_put(endpoint: str, key: str, data: bytes) -> str:
    """``data`` as the object ``key``: its generation."""
    body = "\r\n".join([
        "--part", "Content-Type: application/json", "", json.dumps({"name": key}),
        "--part", "Content-Type: application/octet-stream", "Content-Transfer-Encoding: base64", "",
        base64.b64encode(data).decode(), "--part--", "",
    ]).encode()  # fmt: skip
    made = _post(
        f"{endpoint}/upload/storage/v1/b/models/o?uploadType=multipart", body, "multipart/related; boundary=part"
    )
    return str(made["generation"])


def test_gcs_a_range_read_answered_by_another_generation_is_refused(gcs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GCS: each range read carries ``ifGenerationMatch`` the generation, and an answer of another
    generation (``x-goog-generation``) fails the download, nothing stored."""
    port = int(gcs.rsplit(":", 1)[1])
    a, b = _bytes(5, 3 * MIB + 7), _bytes(6, 3 * MIB + 7)
    generations = {"a.neuropod": _gcs_put(gcs, "a.neuropod", a), "b.neuropod": _gcs_put(gcs, "b.neuropod", b)}
    assert generations["a.neuropod"] != generations["b.neuropod"]

    def edit(path: str, headers: list[tuple[str, str]], body: bytes) -> tuple[list[tuple[str, str]], bytes]:
        name = path.partition("?")[0].rpartition("/")[2]
        if path.startswith("/download/") and name in generations:  # what Google's servers send with the bytes
            return [*headers, ("x-goog-generation", generations[name])], body
        if any(k.lower() == "content-type" and "json" in v for k, v in headers):  # a composite object: no md5Hash
            listed = json.loads(body)
            for item in [listed, *listed.get("items", [])]:
                item.pop("md5Hash", None)
            return headers, json.dumps(listed).encode()
        return headers, body

    path = "/download/storage/v1/b/models/o/a.neuropod"
    with _balancer(port, path, (port, "/download/storage/v1/b/models/o/b.neuropod"), edit=edit) as balancer:
        # Named as Google's clients take an emulator (with token="anon" instead, gcsfs's default filesystem
        # asks for the bucket's layout over gRPC for a minute first); the endpoint again in the options,
        # so that fsspec makes a filesystem of its own for it.
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", balancer.url)
        options = {"endpoint_url": balancer.url}
        with pytest.raises(PackageError, match=CHANGED) as raised:
            storage.fetch("gs://models/a.neuropod", storage_options=options)
        assert balancer.switched and _nothing_stored() == [], _nothing_stored()
        assert f"ifGenerationMatch={generations['a.neuropod']}" in balancer.sent[0][0], balancer.sent
        assert "generation" in str(raised.value), raised.value
        assert storage.fetch("gs://models/a.neuropod", storage_options=options).read_bytes() == a


# --- Azure: two Azurite nodes -------------------------------------------------------------------------

AZURITE = os.environ.get("NEUROPOD_TEST_AZURITE") or shutil.which("azurite-blob")
ACCOUNT = "devstoreaccount1"  # Azurite's development account, published by Microsoft: no secret
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _connection(port: int) -> str:
    return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"


@pytest.fixture(scope="module")
def azurite_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Two Azurite blob services on 127.0.0.1 (a load balancer's two nodes): their ports."""
    if not AZURITE:
        pytest.skip("needs Azurite: NEUROPOD_TEST_AZURITE or azurite-blob on PATH (nox -s tests_storage installs it)")
    pytest.importorskip("adlfs", reason="needs neuropod[azure] (nox -s tests_storage installs it)")
    processes, ports = [], []
    try:
        for _ in range(2):
            workspace, port = tmp_path_factory.mktemp("azurite"), _free_port()
            processes.append(subprocess.Popen(
                [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                 "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"],
                cwd=workspace, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            ports.append(port)
        deadline = time.monotonic() + 60
        for process, port in zip(processes, ports):
            while True:
                assert process.poll() is None, f"Azurite exited with status {process.returncode}"
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"Azurite did not listen on port {port}"
                    time.sleep(0.1)
        yield ports
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _blocks(port: int, data: bytes) -> Any:
    """``data`` committed from blocks as the blob ``models/a.neuropod`` (no Content-MD5): its properties."""
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(_connection(port)) as service:
        with contextlib.suppress(Exception):
            service.create_container("models")
        blob = service.get_blob_client("models", "a.neuropod")
        ids = []
        for n, at in enumerate(range(0, len(data), 2 * MIB)):
            ids.append(base64.b64encode(f"block-{n:04d}".encode()).decode())
            blob.stage_block(ids[-1], data[at : at + 2 * MIB])
        blob.commit_block_list(ids)
        return blob.get_blob_properties()


def test_azure_a_range_read_answered_by_another_node_is_refused(azurite_nodes: list[int]) -> None:
    """Azure: each range read is conditional on the blob's ETag; a node holding another version answers
    412, and the download fails, nothing stored."""
    a, b = _bytes(7, 3 * MIB + 11), _bytes(8, 3 * MIB + 11)
    first = _blocks(azurite_nodes[0], a)
    second = _blocks(azurite_nodes[1], b)
    assert first.content_settings.content_md5 is None and first.etag != second.etag
    path = f"/{ACCOUNT}/models/a.neuropod"
    with _balancer(azurite_nodes[0], path, (azurite_nodes[1], path)) as balancer:
        options = {"connection_string": _connection(int(balancer.url.rsplit(":", 1)[1]))}
        with pytest.raises(PackageError, match=CHANGED) as raised:
            storage.fetch("az://models/a.neuropod", storage_options=options)
        assert balancer.switched and _nothing_stored() == [], _nothing_stored()
        assert balancer.sent[0][1].get("If-Match") == first.etag, balancer.sent
        assert "another version" in str(raised.value), raised.value
        assert storage.fetch("az://models/a.neuropod", storage_options=options).read_bytes() == a
