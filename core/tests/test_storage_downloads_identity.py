"""Downloads from web servers that misbehave: bytes of another version than the one a download is
cached under, a body of unknown size, a server that ignores ``Range`` (Python's ``http.server``),
and an access refused. (Downloads from well-behaved stores: test_storage.py.)"""

from __future__ import annotations

import functools
import hashlib
import http.server
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")

import neuropod
from neuropod import storage
from neuropod.errors import PackageError


def _etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


class _Versions(http.server.BaseHTTPRequestHandler):
    """``/<name>`` of ``files`` with ETags and ranges, a load balancer whose nodes disagree: a HEAD
    answers ``files[name]``, a GET answers ``gets[name]`` when set (another version: its own ETag);
    ``drop`` names whose first GET stops halfway; ``chunked`` names answered in chunks of 64 KiB
    without a length, ``sent`` counting what went; ``status`` names answered with that status."""

    files: dict[str, bytes]
    gets: dict[str, bytes]
    drop: set[str]
    chunked: dict[str, int]
    sent: dict[str, int]
    status: dict[str, int]
    protocol_version = "HTTP/1.1"

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        name = self.path.lstrip("/").partition("?")[0]
        if name in self.status:
            self.send_response(self.status[name])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if name in self.chunked:
            self._chunks(name, head)
            return
        if name not in self.files:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.files[name] if head else self.gets.get(name, self.files[name])
        start, end = 0, len(data) - 1
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            a, _, b = ranged[6:].partition("-")
            start = int(a) if a else 0
            end = min(int(b), len(data) - 1) if b else len(data) - 1
        body = data[start : end + 1]
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", _etag(data))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if head:
            return
        if name in self.drop:
            self.drop.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)

    def _chunks(self, name: str, head: bool) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("ETag", '"endless"')
        self.end_headers()
        if head:
            return
        piece = b"\0" * (64 * 1024)
        try:
            for _ in range(self.chunked[name] // len(piece)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.sent[name] = self.sent.get(name, 0) + len(piece)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client stopped reading
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, type[_Versions]]]:
    handler = type("Versions", (_Versions,), {"files": {}, "gets": {}, "drop": set(), "chunked": {}, "sent": {},
                                              "status": {}})  # fmt: skip
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@pytest.fixture
def web(server: tuple[str, type[_Versions]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(storage.transfer, "FIRST_WAIT_S", 0.01)
    _, handler = server
    yield server
    for table in (handler.files, handler.gets, handler.chunked, handler.sent, handler.status):
        table.clear()
    handler.drop.clear()


def _leftovers() -> list[str]:
    """What the download cache holds besides finished downloads (and its own folders)."""
    root = storage.downloads_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if len(p.name) != 64 and p.name not in ("urls", "locks"))


def _finished() -> list[Path]:
    root = storage.downloads_dir()
    return [p for p in root.iterdir() if len(p.name) == 64] if root.is_dir() else []


def test_a_get_answered_with_another_version_is_never_stored(web: Any) -> None:
    base, handler = web
    rng = np.random.default_rng(7)
    a, b = rng.bytes(200_000), rng.bytes(200_000)  # two versions of one size
    # The node that answers the HEAD has version A; the one that answers the GET has B.
    handler.files["v.zip"], handler.gets["v.zip"] = a, b
    with pytest.raises(PackageError, match=r"http://127\.0\.0\.1:\d+/v\.zip changed while it was being downloaded"):
        storage.fetch(f"{base}/v.zip")
    assert _finished() == [] and _leftovers() == []
    # Every node has A again: A is what loads (nothing of B was kept under A's identity).
    del handler.gets["v.zip"]
    assert storage.fetch(f"{base}/v.zip").read_bytes() == a
    # A download resumed after a dropped connection, whose range read reaches a node with B.
    handler.files["w.zip"] = a
    handler.drop.add("w.zip")
    original = handler._serve

    def serve(self: Any, head: bool) -> None:
        if not head and self.headers.get("Range"):
            handler.gets["w.zip"] = b
        original(self, head)

    handler._serve = serve  # type: ignore[method-assign]
    try:
        with pytest.raises(PackageError, match=r"w\.zip changed while it was being downloaded"):
            storage.fetch(f"{base}/w.zip")
    finally:
        del handler._serve
    assert "w.zip" not in handler.drop  # it did drop, and was resumed with a range
    assert [p for p in _finished() if (p / "package.zip").read_bytes() != a] == [] and _leftovers() == []


def test_a_body_of_unknown_size_stops_at_the_package_limit(web: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    base, handler = web
    monkeypatch.setenv("NEUROPOD_MAX_PACKAGE_BYTES", str(1024 * 1024))
    handler.chunked["endless.zip"] = 64 * 1024 * 1024
    with pytest.raises(PackageError, match=r"endless\.zip holds more than the 1,048,576 bytes a package may hold "
                       r"\(NEUROPOD_MAX_PACKAGE_BYTES\)"):  # fmt: skip
        storage.fetch(f"{base}/endless.zip")
    assert _finished() == [] and _leftovers() == []
    # The download stopped at the limit: the server could not send the rest (socket buffers aside).
    assert handler.sent.get("endless.zip", 0) < 32 * 1024 * 1024, handler.sent


def test_a_403_says_access_denied(web: Any) -> None:
    base, handler = web
    handler.status["secret.zip"] = 403
    with pytest.raises(PackageError, match=r"Access denied to http://127\.0\.0\.1:\d+/secret\.zip \(HTTP 403\)") as e:
        neuropod.load_neuropod(f"{base}/secret.zip?sig=abc")
    assert "No Neuropod package" not in str(e.value) and "sig=" not in str(e.value)


# --- Python's http.server, which ignores Range ---------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(value)) + value


@pytest.fixture(scope="module")
def large_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ONNX demo (``out = (x + y) * 2``) with an unused initializer of 17 MiB of random bits: a
    package over one 16 MiB chunk that does not compress."""
    pytest.importorskip("neuropod_onnx", reason="needs neuropod-onnx and onnxruntime")
    pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    from neuropod_onnx.demo import INPUT_SPEC, OUTPUT_SPEC, demo_model_bytes
    from neuropod_onnx.packager import create_onnx_neuropod

    count = 17 * 1024 * 1024 // 4
    raw = np.random.default_rng(3).bytes(count * 4)  # never read: any bits will do, and random ones do not shrink
    dims = b"\x08" + _varint(count)  # TensorProto: dims (1), data_type (2) FLOAT, name (8), raw_data (9)
    tensor = dims + b"\x10\x01" + _field(8, b"pad") + _field(9, raw)
    # A second `graph` field merges into the first: the demo's graph with one more initializer (5).
    model = demo_model_bytes() + _field(7, _field(5, tensor))
    root = tmp_path_factory.mktemp("large")
    create_onnx_neuropod(root / "big", "demo_big", INPUT_SPEC, OUTPUT_SPEC, onnx_model=model)
    shutil.make_archive(str(root / "www" / "big"), "zip", root / "big")
    path = root / "www" / "big.zip"
    assert path.stat().st_size > 16 * 1024 * 1024
    return path


class _DropsOnce(http.server.SimpleHTTPRequestHandler):
    """Python's file server (no ETag, no ranges); its first GET of a file stops halfway."""

    dropped: list[str]

    def copyfile(self, source: Any, outputfile: Any) -> None:
        if not self.dropped:
            self.dropped.append(self.path)
            outputfile.write(source.read(8 * 1024 * 1024))
            outputfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        super().copyfile(source, outputfile)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_package_over_16_mib_loads_from_python_http_server(
    large_package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(storage.transfer, "FIRST_WAIT_S", 0.01)
    caplog.set_level("INFO", "neuropod.storage")
    handler = functools.partial(type("Drops", (_DropsOnce,), {"dropped": []}), directory=str(large_package.parent))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/big.zip"
        with neuropod.load_neuropod(url) as model:
            x = np.array([[1, 2], [3, 4]], np.float32)
            y = np.array([[7, 8], [9, 10]], np.float32)
            np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], (x + y) * 2)
        assert handler.func.dropped  # type: ignore[attr-defined]  # the first GET did drop, and was retried
        assert not any("resuming" in r.getMessage() for r in caplog.records), caplog.text  # no ranges asked
        assert [p.name for p in _finished()] and _leftovers() == []
        assert (_finished()[0] / "package.zip").read_bytes() == large_package.read_bytes()
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
