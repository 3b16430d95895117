"""What a download killed half-way leaves in the download cache: its partial file (a zip object) or
directory (a prefix), ``downloads/<key>.partial``. The next load of its URL resumes it; one that
never comes must not leave it forever: ``neuropod cache prune`` and ``neuropod cache verify
--repair`` remove a partial download that no process is writing (nobody holds its download's
lock) and that was last written over an hour ago; a fresh one, or one being written, stays.
The first tests lay the partials out as a killed download leaves them (no store needed); the last
kills a real download from a local web server half-way (it needs ``neuropod[http]``).
"""

from __future__ import annotations

import http.server
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuropod import cache, storage
from neuropod.cli import main

HOUR = cache.STALE_SECONDS


@pytest.fixture
def downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    root = cache.make_private_dir("downloads", "download cache")
    assert root == storage.downloads_dir()
    return root


def _partial(root: Path, key: str, *, age_s: float, prefix: bool = False) -> Path:
    """A partial download, as a killed one leaves it, last written ``age_s`` seconds ago."""
    path = root / f"{key * 64}.partial"
    then = time.time() - age_s
    if prefix:  # a prefix's files, some of them written
        (path / "0" / "data").mkdir(parents=True)
        for name, data in (("config.json", b"{}"), ("0/data/model.onnx", b"\x08\x07" * 500)):
            (path / name).write_bytes(data)
            os.utime(path / name, (then, then))
        for d in (path / "0" / "data", path / "0", path):
            os.utime(d, (then, then))
    else:
        path.write_bytes(b"PK\x03\x04" + b"\0" * 4096)
        os.utime(path, (then, then))
    return path


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_prune_removes_stale_partial_downloads(downloads: Path) -> None:
    old_zip = _partial(downloads, "a", age_s=2 * HOUR)
    old_prefix = _partial(downloads, "b", age_s=2 * HOUR, prefix=True)
    fresh = _partial(downloads, "c", age_s=60)
    busy = _partial(downloads, "d", age_s=2 * HOUR)
    with cache.entry_lock(downloads, "d" * 64):  # a download of it is running in another process
        code, out = _run("cache", "prune", "--dry-run")
        assert code == 0 and old_zip.exists() and old_prefix.exists(), out
        assert f"Would remove {old_zip} (4,100 bytes, left by an interrupted download)" in out, out
        assert f"Would remove {old_prefix} (1,002 bytes, left by an interrupted download)" in out, out
        code, out = _run("cache", "prune")
    assert code == 0, out
    assert not old_zip.exists() and not old_prefix.exists(), out
    assert fresh.exists() and busy.exists(), out
    assert f"Removed {old_zip} (4,100 bytes, left by an interrupted download)" in out, out
    assert (
        "Removed 0 download(s) unused for 30 day(s) and 2 partial one(s) of interrupted downloads, 5,102 bytes" in out
    ), out
    # --days 0: every download not being made right now, a fresh partial one too.
    code, out = _run("cache", "prune", "--days", "0")
    assert code == 0 and not fresh.exists() and not busy.exists(), out
    assert sorted(p.name for p in downloads.iterdir()) == [], sorted(p.name for p in downloads.iterdir())


def test_verify_reports_and_repair_removes_stale_partial_downloads(downloads: Path) -> None:
    old_zip = _partial(downloads, "a", age_s=2 * HOUR)
    old_prefix = _partial(downloads, "b", age_s=2 * HOUR, prefix=True)
    fresh = _partial(downloads, "c", age_s=60)
    code, out = _run("cache", "verify")
    assert code == 1, out
    assert f"{old_zip}: a partial download left by an interrupted download" in out, out
    assert f"{old_prefix}: a partial download" in out and str(fresh) not in out, out
    code, out = _run("cache", "verify", "--repair")
    assert code == 0 and "(removed)" in out, out
    assert not old_zip.exists() and not old_prefix.exists() and fresh.exists(), out
    code, out = _run("cache", "verify")
    assert code == 0 and "every entry matches its record" in out, out


class _Stalls(http.server.BaseHTTPRequestHandler):
    """A 3 MiB file whose GET sends 2 MiB, then waits until ``release`` is set (a download that the
    process making it is killed in the middle of)."""

    release: threading.Event
    protocol_version = "HTTP/1.1"
    SIZE = 3 << 20

    def do_HEAD(self) -> None:
        self._headers()

    def do_GET(self) -> None:
        self._headers()
        self.wfile.write(b"\x01" * (2 << 20))
        self.wfile.flush()
        self.release.wait(30)
        self.close_connection = True

    def _headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(self.SIZE))
        self.send_header("ETag", '"v1"')
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stalling() -> Iterator[str]:
    pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")
    handler = type("Stalls", (_Stalls,), {"release": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/adder.zip"
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_download_killed_half_way_leaves_a_partial_that_prune_removes_once_stale(
    downloads: Path, stalling: str
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from neuropod import storage; storage.fetch(sys.argv[1])", stalling],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not [p for p in downloads.glob("*.partial") if p.stat().st_size > 0]:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the download did not start"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    (partial,) = downloads.glob("*.partial")
    # Just killed: kept, for the next load of the URL to resume.
    assert _run("cache", "prune")[0] == 0 and _run("cache", "verify")[0] == 0 and partial.exists()
    then = time.time() - 2 * HOUR
    os.utime(partial, (then, then))
    code, out = _run("cache", "prune")
    assert code == 0 and not partial.exists(), out
    assert f"Removed {partial} (" in out and "and 1 partial one(s) of interrupted downloads" in out, out
