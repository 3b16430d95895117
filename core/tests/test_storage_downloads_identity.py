"""Downloads from web servers that misbehave: bytes of another version than the one a download is
cached under, a body of unknown size, a server that ignores ``Range`` (Python's ``http.server``),
and an access refused. (Downloads from well-behaved stores: test_storage.py.)"""

from __future__ import annotations

import functools
import http.server
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")

import neuropod
from _web_server import Site, serving, web_server
from neuropod import storage
from neuropod.errors import PackageError


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Site]]:
    """A load balancer whose nodes disagree (a GET answering another version than the HEAD: ``gets``,
    ``switch_on_range``), connections dropped halfway, bodies of unknown size, statuses."""
    site = Site()
    with web_server(site) as base:
        yield base, site


@pytest.fixture
def web(server: tuple[str, Site], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Site]]:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(storage.transfer, "FIRST_WAIT_S", 0.01)
    yield server
    server[1].reset()


def _leftovers() -> list[str]:
    """What the download cache holds besides finished downloads (and its own folders)."""
    root = storage.downloads_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if len(p.name) != 64 and p.name not in ("urls", "locks"))


def _finished() -> list[Path]:
    root = storage.downloads_dir()
    return [p for p in root.iterdir() if len(p.name) == 64] if root.is_dir() else []


def test_a_get_answered_with_another_version_is_never_stored(web: tuple[str, Site]) -> None:
    base, site = web
    rng = np.random.default_rng(7)
    a, b = rng.bytes(200_000), rng.bytes(200_000)  # two versions of one size
    # The node that answers the HEAD has version A; the one that answers the GET has B.
    site.files["v.zip"], site.gets["v.zip"] = a, b
    with pytest.raises(PackageError, match=r"http://127\.0\.0\.1:\d+/v\.zip changed while it was being downloaded"):
        storage.fetch(f"{base}/v.zip")
    assert _finished() == [] and _leftovers() == []
    # Every node has A again: A is what loads (nothing of B was kept under A's identity).
    del site.gets["v.zip"]
    assert storage.fetch(f"{base}/v.zip").read_bytes() == a
    # A download resumed after a dropped connection, whose range read reaches a node with B.
    site.files["w.zip"] = a
    site.drop.add("w.zip")
    site.switch_on_range["w.zip"] = b
    with pytest.raises(PackageError, match=r"w\.zip changed while it was being downloaded"):
        storage.fetch(f"{base}/w.zip")
    assert "w.zip" not in site.drop  # it did drop, and was resumed with a range
    assert [p for p in _finished() if (p / "package.zip").read_bytes() != a] == [] and _leftovers() == []


def test_a_body_of_unknown_size_stops_at_the_package_limit(web: tuple[str, Site], monkeypatch: pytest.MonkeyPatch) -> None:
    base, site = web
    monkeypatch.setenv("NEUROPOD_MAX_PACKAGE_BYTES", str(1024 * 1024))
    site.chunked["endless.zip"] = 64 * 1024 * 1024
    with pytest.raises(PackageError, match=r"endless\.zip holds more than the 1,048,576 bytes a package may hold "
                       r"\(NEUROPOD_MAX_PACKAGE_BYTES\)"):  # fmt: skip
        storage.fetch(f"{base}/endless.zip")
    assert _finished() == [] and _leftovers() == []
    # The download stopped at the limit: the server could not send the rest (socket buffers aside).
    assert site.sent.get("endless.zip", 0) < 32 * 1024 * 1024, site.sent


def test_a_403_says_access_denied(web: tuple[str, Site]) -> None:
    base, site = web
    site.status["secret.zip"] = 403
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
    with serving(handler) as base:
        url = f"{base}/big.zip"
        with neuropod.load_neuropod(url) as model:
            x = np.array([[1, 2], [3, 4]], np.float32)
            y = np.array([[7, 8], [9, 10]], np.float32)
            np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], (x + y) * 2)
        assert handler.func.dropped  # type: ignore[attr-defined]  # the first GET did drop, and was retried
        assert not any("resuming" in r.getMessage() for r in caplog.records), caplog.text  # no ranges asked
        assert [p.name for p in _finished()] and _leftovers() == []
        assert (_finished()[0] / "package.zip").read_bytes() == large_package.read_bytes()
