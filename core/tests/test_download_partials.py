"""What a download killed half-way leaves in the download cache: its partial file (a zip object) or
directory (a prefix), ``downloads/<key>.partial``. The next load of its URL resumes it; one that
never comes must not leave it forever: ``neuropod cache prune`` and ``neuropod cache verify
--repair`` remove a partial download that no process is writing (nobody holds its download's
lock) and that was last written over an hour ago; a fresh one, or one being written, stays.
No store is needed: the partials are laid out as a killed download leaves them.
"""

from __future__ import annotations

import io
import os
import time
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
