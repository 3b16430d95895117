"""What a removal killed half-way leaves in the download cache: the cache removes a download (or a
partial one) by renaming it to ``downloads/.trash-<random>`` and then deleting that; a process killed
between the two leaves the ``.trash-`` folder forever. ``neuropod cache prune`` and ``neuropod cache
verify --repair`` remove one that nothing changed for an hour (a removal under way deletes in it all
the time); a fresh one stays (``prune --days 0``: any).

The first test makes a real one: a process whose removal is killed right after the rename.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuropod import cache, storage
from neuropod.cli import main

HOUR = cache.STALE_SECONDS

#: Removes the folder given with the cache's own removal, killed (SIGKILL) once the folder is
#: renamed aside and before it is deleted.
KILLED_REMOVAL = """
import os, shutil, signal, sys
from pathlib import Path

from neuropod import cache

shutil.rmtree = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
cache.remove_path(Path(sys.argv[1]))
"""


@pytest.fixture
def downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    root = cache.make_private_dir("downloads", "download cache")
    assert root == storage.downloads_dir()
    return root


def _aged(path: Path, age_s: float) -> None:
    """``path`` and everything under it last written ``age_s`` seconds ago."""
    then = time.time() - age_s
    for p in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
        os.utime(p, (then, then), follow_symlinks=False)
    os.utime(path, (then, then))


def _download(root: Path, key: str) -> Path:
    """A download's folder as the cache lays one out: its zip and its record (2,000 + 20 bytes)."""
    entry = root / (key * 64)
    entry.mkdir()
    (entry / "package.zip").write_bytes(b"\x01" * 2000)
    (entry / "record.json").write_bytes(b"{" + b" " * 18 + b"}")
    return entry


def _trash(root: Path, key: str, *, age_s: float) -> Path:
    """A ``.trash-`` folder as a removal killed half-way leaves it, last changed ``age_s`` seconds ago."""
    entry = _download(root, key)
    trash = root / f".trash-{key * 16}"
    entry.rename(trash)
    _aged(trash, age_s)
    return trash


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_removal_killed_half_way_leaves_a_trash_folder_that_prune_removes_once_stale(downloads: Path) -> None:
    entry = _download(downloads, "a")
    done = subprocess.run([sys.executable, "-c", KILLED_REMOVAL, str(entry)], capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()
    left = [p for p in downloads.iterdir() if p.name.startswith(".trash-")]
    assert len(left) == 1 and not entry.exists(), _names(downloads)
    trash = left[0]
    assert (trash / "package.zip").stat().st_size == 2000  # the download, renamed aside, not deleted
    code, out = _run("cache", "prune")  # fresh: perhaps a removal under way
    assert code == 0 and trash.exists(), out
    _aged(trash, 2 * HOUR)
    code, out = _run("cache", "prune")
    assert code == 0 and not trash.exists(), out
    assert f"Removed {trash} (2,020 bytes, left by an interrupted removal)" in out, out
    assert "and 1 folder(s) of interrupted removals, 2,020 bytes" in out, out


def test_prune_removes_stale_trash_folders(downloads: Path) -> None:
    old = _trash(downloads, "b", age_s=2 * HOUR)
    fresh = _trash(downloads, "c", age_s=60)
    code, out = _run("cache", "prune", "--dry-run")
    assert code == 0 and old.exists(), out
    assert f"Would remove {old} (2,020 bytes, left by an interrupted removal)" in out, out
    code, out = _run("cache", "prune")
    assert code == 0 and not old.exists() and fresh.exists(), out
    # --days 0: every one, a fresh one too.
    code, out = _run("cache", "prune", "--days", "0")
    assert code == 0 and not fresh.exists(), out
    assert _names(downloads) == [], _names(downloads)


def test_verify_reports_and_repair_removes_stale_trash_folders(downloads: Path) -> None:
    old = _trash(downloads, "d", age_s=2 * HOUR)
    fresh = _trash(downloads, "e", age_s=60)
    code, out = _run("cache", "verify")
    assert code == 1, out
    assert f"{old}: a folder left by an interrupted removal" in out and str(fresh) not in out, out
    code, out = _run("cache", "verify", "--repair")
    assert code == 0 and f"{old}: a folder left by an interrupted removal" in out and "(removed)" in out, out
    assert not old.exists() and fresh.exists(), out
    code, out = _run("cache", "verify")
    assert code == 0 and "every entry matches its record" in out, out
